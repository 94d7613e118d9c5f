"""Algorithm plugins: advantage estimators, policy losses and KL penalties (pure tensor functions)."""
