"""A pipeline schedule as data: one ordered list of :class:`MetaStep` per rank.

Names follow HyperParallel's API (``MetaStep(micro_index, step_type, stage_index)``, ``MetaStepType``) so a
schedule written for it reads the same here. Stages are numbered along the model (stage 0 holds the
embedding, the last stage the loss); :class:`StageLayout` says which rank runs which stage:

- ``loop`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1): stage ``s`` on rank ``s % ranks``; chunk ``s // ranks``;
- ``v`` (ZBV): two chunks per rank in a V — stage ``s < ranks`` on rank ``s``, stage ``s >= ranks`` on rank
  ``2 * ranks - 1 - s`` (chunk 1 goes back up, so rank 0 holds both the first and the last stage).

Communication actions name the stage that sends or consumes: ``SEND_F`` / ``SEND_B`` carry the stage
whose output (activation, or input gradient) leaves; ``RECV_F`` / ``RECV_B`` the stage that will use what
arrives. Between two stages on the same rank (the bottom of the V) nothing is sent: the runtime hands the
tensor over in memory, and lists carry no communication action for it.
"""

from __future__ import annotations

import dataclasses
import enum


class MetaStepType(enum.Enum):
    # HyperParallel's member names first (canonical); our earlier spellings follow as enum aliases of the
    # same members. The values are this package's schedule notation ("F0s1", "SF0s1" in timelines, error
    # messages and the validator's keys), kept where HyperParallel spells the communication steps
    # "FS"/"FR"/"BS"/"BR" and the overlapped pair "OFB".
    FORWARD = "F"         # forward of one micro-batch through one stage
    BACKWARD = "B"        # full backward: input and weight gradients
    BWD_INPUT = "I"       # input gradient only; the weight gradient waits for a BWD_WEIGHT (zero bubble)
    BWD_WEIGHT = "W"      # the deferred weight gradient of an earlier BWD_INPUT
    OVERLAP_F_B = "FB"    # an overlapped pair: this step's forward with ``pair``'s backward
    FWD_SEND = "SF"       # activation to the next stage
    FWD_RECV = "RF"       # activation from the previous stage
    BWD_SEND = "SB"       # input gradient to the previous stage
    BWD_RECV = "RB"       # output gradient from the next stage
    # Aliases. OVERLAP_B_F: the runtime runs an overlapped pair's two halves together, so which one is
    # issued first is not a separate step type here; it names the same member as OVERLAP_F_B.
    OVERLAP_B_F = "FB"
    FWD = "F"
    BWD = "B"
    FWD_BWD = "FB"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    @property
    def is_comm(self) -> bool:
        return self in COMM_TYPES

    @property
    def is_compute(self) -> bool:
        return self not in COMM_TYPES


COMM_TYPES = frozenset({MetaStepType.SEND_F, MetaStepType.RECV_F, MetaStepType.SEND_B, MetaStepType.RECV_B})


@dataclasses.dataclass(frozen=True)
class MetaStep:
    """One action of one rank: ``step_type`` for micro-batch ``micro_index`` on stage ``stage_index``.

    ``pair`` is set only for ``FWD_BWD``: the backward (``BWD`` or ``BWD_INPUT``) run overlapped with this
    step's forward (which is ``micro_index`` / ``stage_index`` themselves).
    """

    micro_index: int
    step_type: MetaStepType
    stage_index: int
    pair: MetaStep | None = None

    def __post_init__(self):
        if not isinstance(self.step_type, MetaStepType):
            raise TypeError(f"MetaStep.step_type must be a MetaStepType, got {self.step_type!r}")
        if (self.step_type is MetaStepType.FWD_BWD) != (self.pair is not None):
            raise ValueError(f"MetaStep {self}: a pair is given exactly for FWD_BWD steps")
        if self.pair is not None and self.pair.step_type not in (MetaStepType.BWD, MetaStepType.BWD_INPUT):
            raise ValueError(f"MetaStep {self}: the pair of FWD_BWD is a BWD or BWD_INPUT step")

    def __str__(self) -> str:
        text = f"{self.step_type.value}{self.micro_index}s{self.stage_index}"
        return text if self.pair is None else f"{text}+{self.pair}"

    __repr__ = __str__

    @property
    def sub_steps(self) -> tuple[MetaStep, ...]:
        """HyperParallel's name: an overlapped step's two compute steps (forward, backward); () otherwise."""
        return self.halves() if self.pair is not None else ()

    def halves(self) -> tuple[MetaStep, ...]:
        """The compute steps this action runs: itself, or for FWD_BWD its forward then its backward."""
        if self.pair is None:
            return (self,)
        return (MetaStep(self.micro_index, MetaStepType.FWD, self.stage_index), self.pair)


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which rank runs which stage: ``ranks`` pipeline ranks, ``chunks`` stages per rank, ``style`` loop or v."""

    ranks: int
    chunks: int = 1
    style: str = "loop"

    def __post_init__(self):
        if self.ranks < 1 or self.chunks < 1:
            raise ValueError(f"StageLayout: ranks ({self.ranks}) and chunks ({self.chunks}) must be >= 1")
        if self.style not in ("loop", "v"):
            raise ValueError(f"StageLayout: style is 'loop' or 'v', got {self.style!r}")
        if self.style == "v" and self.chunks != 2:
            raise ValueError(f"StageLayout: the V layout has two chunks per rank, got {self.chunks}")

    @property
    def num_stages(self) -> int:
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.style == "v" and stage >= self.ranks:
            return 2 * self.ranks - 1 - stage
        return stage % self.ranks

    def chunk_of(self, stage: int) -> int:
        return stage // self.ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        if self.style == "v" and chunk == 1:
            return 2 * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def stages_of(self, rank: int) -> list[int]:
        """This rank's stages, by chunk."""
        return [self.stage_of(rank, c) for c in range(self.chunks)]


__all__ = ["MetaStep", "MetaStepType", "StageLayout", "COMM_TYPES"]
