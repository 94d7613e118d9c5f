"""Environment plugins (kind ``environment``): what a multi-turn episode's model talks to, one instance per
trajectory."""
