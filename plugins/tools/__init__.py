"""Tool plugins (kind ``tool``): functions a multi-turn episode's model can call, each with a JSON schema."""
