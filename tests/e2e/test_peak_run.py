"""hyper_adaptor.testing.peak_run on a real run: examples/pretrain_gpt.py on 2 forked CPU ranks (DP2, a
2-layer hidden-64 GPT), the measurement bench/dry_run.py compares the dry run's prediction with."""

import pytest

from hyper_adaptor.testing.peak_run import measure

pytestmark = pytest.mark.e2e
LAYERS, HIDDEN, FFN, VOCAB, SEQ = 2, 64, 256, 1024, 128
MODEL = (
    f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads 4 --ffn-hidden-size {FFN} "
    f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
    "--seed 1234 --use-cpu-initialization --hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 1 "
    f"--eval-interval 1000 --eval-iters 0 --tokenizer-type NullTokenizer --vocab-size {VOCAB} --mock-data "
    "--num-workers 0 --no-bias-gelu-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion"
).split()


def gpt_parameters() -> int:
    """The local spec's GPT with biases, tied embedding and learned positions, counted by hand."""
    h, f = HIDDEN, FFN
    layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h  # qkv, proj, fc1, fc2, 2 LN
    return VOCAB * h + SEQ * h + LAYERS * layer + 2 * h  # + the final LN


@pytest.fixture(scope="module")
def ranks():
    return measure(MODEL, 2, iters=2, timed_iters=1, timeout=300)


def test_peak_holds_the_model_state_and_the_replicas_agree(ranks):
    fp32 = 4 * gpt_parameters()
    for r in ranks:
        parts = r["parts_at_peak"]
        assert parts["parameters"] == fp32, parts
        assert parts["gradients"] == fp32, parts  # megatron's DDP grad buffer (fp32 main_grad)
        assert 2 * fp32 <= parts["optimizer_state"] <= 2 * fp32 + 4096, parts  # Adam's moments and steps
        assert parts["other"] > 0 and sum(parts.values()) == r["peak"]
        # the peak is in a step that holds the optimizer state: the second, not the first
        assert r["peak_iteration"] == 2 and r["host_peak"] == 0 and not r["tracker_left_on"]
        assert r["iterations"] == 3 and r["step_time_s"] > 0 and not r["step_time_tracked"]
    # data-parallel replicas do the same work on the same shapes: the same peak to the byte
    assert ranks[0]["peak"] == ranks[1]["peak"], [r["peak"] for r in ranks]
