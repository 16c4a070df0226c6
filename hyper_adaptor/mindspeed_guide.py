"""docs/migrating-from-mindspeed.md, generated from the table in hyper_adaptor/mindspeed_flags.py:
``python -m hyper_adaptor mindspeed-flags --markdown > docs/migrating-from-mindspeed.md`` (a test compares
the committed page with :func:`markdown`)."""

from __future__ import annotations

import sys

from hyper_adaptor.mindspeed_flag_list import MINDSPEED_COMMIT, NOT_TRAINING_FLAGS
from hyper_adaptor.mindspeed_flags import DISPOSITIONS, MAPPED, MEGATRON_FLAGS, ROWS, page_of, rows_of

INTRO = """# Migrating from MindSpeed

A MindSpeed training script is a Megatron script with one extra import. To run it with hyper_adaptor,
change that line and keep the launch command:

```python
import torch
import hyper_adaptor.megatron_adaptor   # in place of: import mindspeed.megatron_adaptor
```

Then launch as before (`torchrun ... pretrain_gpt.py <the same flags>`), adding `--optimization-level N`
if you want fewer features than level 2 (the default). Check a launch line before a run, on any machine,
without training: `python -m hyper_adaptor describe <the same flags>` lists, under "MindSpeed's flags",
what each MindSpeed flag on the line becomes here.

Every flag MindSpeed's feature pages name gets one answer (a flag whose answer depends on its value gets
one row per value):

- **same**: megatron or hyper_adaptor defines the flag with MindSpeed's meaning; nothing changes.
- **mapped**: the flag sets hyper_adaptor's (or megatron's) own flag for the same thing; one notice at
  start-up names both. Writing the new flag instead silences the notice.
- **noop**: the flag only tunes a path of Ascend's (or of MindSpeed's own implementation) that does not
  run here, and training computes the same without it; accepted, with one notice saying why. Remove it
  when you like.
- **refused**: there is nothing equivalent here; the run stops in its argument checks, before any process
  group or model is built, with one error naming the flag and what to use instead (exit status 2, like
  any bad flag). Remove or replace it.

A flag given with MindSpeed's default value asks for nothing and gets no notice. hyper_adaptor serves
its features on every device (NPU, CUDA, CPU), so the Ascend-only switches that select MindSpeed's
kernels for a feature are not needed: the fused kernels are chosen by `--optimization-level` (1 and up)
and `--fused-backend`.
"""



def markdown() -> str:
    """docs/migrating-from-mindspeed.md: the introduction, then the table."""
    lines = [INTRO.rstrip(), ""]
    counts = {d: sum(r.disposition == d for r in ROWS) for d in DISPOSITIONS}
    lines += [f"## MindSpeed's flags, one row each ({len(ROWS)} rows: "
              + ", ".join(f"{counts[d]} {d}" for d in DISPOSITIONS) + ")", "",
              "| flag | value | here | answer | MindSpeed page |", "|---|---|---|---|---|"]
    for row in ROWS:
        value = f"`{row.value}`" if row.value else ("other values" if len(rows_of(row.flag)) > 1 else "")
        answer = row.note or "hyper_adaptor's flag, with MindSpeed's meaning"
        if row.disposition == MAPPED:
            answer = f"`{row.target.replace('{names}', 'NAME...')}`: {row.note}"
        lines.append(f"| `{row.flag}` | {value} | {row.disposition} | {answer} | {page_of(row.flag)} |")
    lines += ["", f"## Megatron's own flags on MindSpeed's pages ({len(MEGATRON_FLAGS)}): same", "",
              "Megatron defines each with MindSpeed's meaning; they work here as megatron defines them: "
              + ", ".join(f"`{flag}`" for flag in MEGATRON_FLAGS) + ".", "",
              "## Named on MindSpeed's pages, read by another program", ""]
    lines += [f"- `{flag}`: {tool}" for flag, tool in NOT_TRAINING_FLAGS.items()]
    lines += ["", f"Read from MindSpeed's `docs/zh/features/` at commit `{MINDSPEED_COMMIT}`; the table is "
              "`hyper_adaptor/mindspeed_flags.py` (`ROWS`), this page is generated from it by "
              "`python -m hyper_adaptor mindspeed-flags --markdown`.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m hyper_adaptor mindspeed-flags --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0
