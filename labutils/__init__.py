"""Helpers for the executable book on numeric precision in RL fine-tuning."""
from .env import env_report

__all__ = ["env_report"]
