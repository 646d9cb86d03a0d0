"""``python -m rollflow.trainer.zero_adapter OUT MODEL LORA_JSON``: write a run's zero adapter.

The adapter vLLM serves before a run's first sync under ``train.lora.sync = "adapter"``
(``lora.save_initial_adapter``: A = B = 0, the base model), written to the folder ``OUT`` for the
model at ``MODEL`` and the ``[train.lora]`` section given as JSON. The run process runs it as a
short child (``protocol.ZERO_ADAPTER_MODULE``), so it loads neither the trainer's code nor peft.
Exit 0: written; 2: the config does not fit the model (the message on stderr's last line);
anything else: it failed (the traceback on stderr).
"""

from __future__ import annotations

import sys

from rollflow.infra.config import LoraSection
from rollflow.infra.errors import InputError


def main(argv: list[str] | None = None) -> None:
    out, model_dir, lora_json = argv if argv is not None else sys.argv[1:]
    from rollflow.trainer.lora import save_initial_adapter

    try:
        save_initial_adapter(out, model_dir, LoraSection.model_validate_json(lora_json))
    except InputError as err:
        print(err, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
