"""Reward plugins: rule-based reward functions with verl's contract."""
