"""Helpers for the executable book on numeric precision in RL fine-tuning."""
import warnings

# tqdm.auto, imported by transformers, warns in notebooks without ipywidgets; its text bars are fine.
warnings.filterwarnings("ignore", message="IProgress not found")
# trl still calls transformers' gradient_checkpointing names, renamed in transformers 5: nothing to teach here.
warnings.filterwarnings("ignore", message=r"`\w+` is deprecated and will be removed in v6", category=FutureWarning)

from .env import env_report  # noqa: E402

__all__ = ["env_report"]
