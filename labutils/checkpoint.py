"""Saving a checkpoint atomically: a folder appears complete, with its record, or not at all."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def save(model, tokenizer, target: Path, record_file: str, record: dict) -> None:
    """`save_pretrained` of `model` and `tokenizer` into `target`, with `record` as JSON in `record_file`.

    Everything is written to a staging folder beside `target` first and moved into place in one rename,
    so an interrupted build never leaves a folder that looks complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / record_file).write_text(json.dumps(record, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
