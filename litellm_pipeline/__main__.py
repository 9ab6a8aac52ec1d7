"""``python -m litellm_pipeline +recipe=NAME [overrides]``"""

from __future__ import annotations

import os
import sys

from litellm_pipeline.config.compose import hydra_main
from litellm_pipeline.errors import ConfigError, InvalidValueError, RequestError


def expected_errors() -> tuple[type[BaseException], ...]:
    """What a user can cause (a config, a checkpoint, a tokenizer, a request): one line, not a traceback."""
    from litellm_pipeline.model.config import CheckpointError
    from litellm_pipeline.text.tokenizer import TokenizerError

    return ConfigError, CheckpointError, TokenizerError, RequestError, InvalidValueError


def _task(cfg):
    from litellm_pipeline.parallel.workers import serve_torchrun, torchrun_env
    from litellm_pipeline.tasks import run_task

    env = torchrun_env()
    try:
        if env is not None and env[0] != 0:  # torchrun: ranks past 0 serve their shard to rank 0, which runs the task
            sys.exit(serve_torchrun(cfg))
        return run_task(cfg)
    except expected_errors() as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


main = hydra_main(_task)

if __name__ == "__main__":
    main()
