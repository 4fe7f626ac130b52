"""The heavy imports of a sampler-precision run (trl's GRPO trainer, the model code), loaded once by the
runs' fork server (`mismatch_rl.workers`) so that each worker is forked with them instead of importing
them again. Quiet first: the server's stderr is the chapter's."""
from .mismatch_rl import _quiet_worker

_quiet_worker()

import transformers.models.qwen2.modeling_qwen2  # noqa: E402,F401
import trl.trainer.grpo_trainer  # noqa: E402,F401
import gc  # noqa: E402

gc.freeze()  # as bookbuild.warm's server does: the workers' collections leave the shared heap alone
