"""The learning rates megatron.training logs (examples/pretrain_gpt.py on forked ranks, 1 CPU process, --mock-data)
against ``hyper_adaptor.optim.lr_multiplier`` at every iteration: WSD with each of megatron's four
``--lr-wsd-decay-style`` values, and megatron's linear, cosine and constant ``--lr-decay-style``
(``inverse-square-root`` has no counterpart in the library and is not run).

Every run trains past ``--lr-decay-iters``, so the warmup, the stable phase, the decay and the min lr after
it are all logged. Which step the logged value belongs to: ``train_step`` steps megatron's scheduler after
the optimizer, and ``training_log`` then reads the optimizer's lr, so iteration ``i`` logs the lr after
``i`` scheduler steps (the one iteration ``i + 1`` uses), i.e. ``lr_multiplier(i, ...)``; each test also
shows that the neighbouring alignment ``i - 1`` and a wrong decay style are told apart.

Precision: megatron logs the lr as a float32 written with ``{:.6E}``; the library's value, passed through
the same two roundings, must equal the logged text (float32 alone moves the 7th digit: 9.307693E-04 is
logged for 0.00093076923). The seven runs are independent one-process torchruns started together (each
is mostly startup, and the startups overlap).
"""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hyper_adaptor.optim import lr_multiplier
from tests.e2e.test_pretrain_gpt import MODEL, pretrain

pytestmark = pytest.mark.e2e
LR = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|")
MAX_LR, MIN_LR, WARMUP, DECAY_ITERS, TRAIN_ITERS, WSD_DECAY_ITERS = 1e-3, 1e-4, 4, 30, 32, 10
# later flags override MODEL's (--lr, --min-lr, --lr-decay-style, --lr-warmup-iters); one layer and a
# single micro-batch per iteration: only the schedule is under test
COMMON = ["--mock-data", "--num-workers", "0", "--num-layers", "1", "--global-batch-size", "2",
          "--train-iters", str(TRAIN_ITERS), "--lr", str(MAX_LR), "--min-lr", str(MIN_LR),
          "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(DECAY_ITERS)]
# megatron's --lr-wsd-decay-style value -> the library's wsd_decay_style
WSD_STYLES = {"linear": "linear", "cosine": "cosine", "exponential": "exponential", "minus_sqrt": "1-sqrt"}
RUNS = {
    **{f"WSD-{theirs}": (["--lr-decay-style", "WSD", "--lr-wsd-decay-style", theirs,
                          "--lr-wsd-decay-iters", str(WSD_DECAY_ITERS)],
                         dict(style="wsd", wsd_decay_steps=WSD_DECAY_ITERS, wsd_decay_style=ours))
       for theirs, ours in WSD_STYLES.items()},
    "linear": (["--lr-decay-style", "linear"], dict(style="linear")),
    "cosine": (["--lr-decay-style", "cosine"], dict(style="cosine")),
    "constant": (["--lr-decay-style", "constant"], dict(style="constant")),
}
# for each run, schedules its log must not match (a wrong style of the same family)
WRONG = {
    **{f"WSD-{theirs}": [dict(style="wsd", wsd_decay_steps=WSD_DECAY_ITERS, wsd_decay_style=other)
                         for other in WSD_STYLES.values() if other != ours]
       for theirs, ours in WSD_STYLES.items()},
    # (WSD-linear decaying over all the steps after warmup is linear; over fewer it is not)
    "linear": [dict(style="cosine"), dict(style="wsd", wsd_decay_steps=WSD_DECAY_ITERS)],
    "cosine": [dict(style="linear")],
    "constant": [dict(style="linear")],
}


def expected_lr(step: int, schedule: dict) -> float:
    return MAX_LR * lr_multiplier(step, WARMUP, DECAY_ITERS, min_lr_ratio=MIN_LR / MAX_LR, **schedule)


def as_logged(value: float) -> str:
    """``value`` as megatron's log writes a learning rate: through a float32 tensor (the max over the
    model-parallel group), then ``{:.6E}``."""
    return f"{torch.tensor(value, dtype=torch.float32).item():.6E}"


def mismatches(logged: dict, schedule: dict, shift: int = 0) -> list:
    """Iterations whose logged lr is not ``lr_multiplier`` at ``iteration + shift`` steps."""
    return [(i, lr, as_logged(expected_lr(i + shift, schedule))) for i, lr in sorted(logged.items())
            if lr != as_logged(expected_lr(i + shift, schedule))]


@pytest.fixture(scope="module")
def logs(request):
    # only the selected runs (``-k WSD`` starts four), all at once
    names = {item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")}
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(pretrain, 1, *COMMON, *RUNS[name][0], model=MODEL) for name in names}
        return {name: future.result()[1] for name, future in futures.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_logged_learning_rates_follow_lr_multiplier(logs, name):
    flags, schedule = RUNS[name]
    output = logs[name]
    style = flags[flags.index("--lr-decay-style") + 1]
    assert f"learning rate decay style: {style}" in output
    if style == "WSD":
        assert re.search(rf"lr_wsd_decay_style \.+ {flags[flags.index('--lr-wsd-decay-style') + 1]}\n", output)
    logged = {int(i): lr for i, lr in LR.findall(output)}
    assert sorted(logged) == list(range(1, TRAIN_ITERS + 1)), sorted(logged)
    assert mismatches(logged, schedule) == []
    # the comparison can fail: off by one scheduler step, and with a wrong decay style
    assert mismatches(logged, schedule, shift=-1)
    for wrong in WRONG[name]:
        assert mismatches(logged, wrong), wrong
    if style != "constant":  # past --lr-decay-iters: min lr
        assert [float(logged[i]) for i in range(DECAY_ITERS + 1, TRAIN_ITERS + 1)] == [MIN_LR] * 2
