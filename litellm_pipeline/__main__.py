"""``python -m litellm_pipeline +recipe=NAME [overrides]``"""

from __future__ import annotations

import sys

from litellm_pipeline.errors import ConfigError
from litellm_pipeline.hydra_config import hydra_main


def _task(cfg):
    from litellm_pipeline.tasks import run_task

    try:
        return run_task(cfg)
    except ConfigError as exc:  # a clear message, not a traceback, for a config the user got wrong
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


main = hydra_main(_task)

if __name__ == "__main__":
    main()
