"""Tracker plugins: console and MLflow."""
