"""Helpers for the executable book on numeric precision in RL fine-tuning."""
import warnings

# tqdm.auto, imported by transformers, warns in notebooks without ipywidgets; its text bars are fine.
warnings.filterwarnings("ignore", message="IProgress not found")

from .env import env_report  # noqa: E402

__all__ = ["env_report"]
