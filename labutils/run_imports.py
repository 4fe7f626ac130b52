"""What every sampler-precision run imports, loaded once by the runs' fork server (`mismatch_rl.workers`)
so that each worker is forked with it instead of importing it again. Quiet first: the server's stderr
is the chapter's."""
from .mismatch_rl import _quiet_worker

_quiet_worker()

import transformers.models.qwen2.modeling_qwen2  # noqa: E402,F401
import trl.trainer.grpo_trainer  # noqa: E402,F401
