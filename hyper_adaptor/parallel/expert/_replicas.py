"""Hot-expert replicas: the most loaded experts get extra copies on the least loaded EP ranks.

Routing is skewed in practice: a few experts take most tokens and the ranks that own them set the
step time. Every ``interval`` steps the token counts measured over the window (summed over the EP
group, so every rank plans the same) pick experts to replicate; each replica lives on the least
loaded rank that holds no copy of that expert yet. The plan is a list of *slots* (virtual experts):
E owned ones plus R replicas, ordered by the rank that computes them, so the dispatcher sees an
uneven ``placement`` (slots per rank) and runs unchanged on a routing map over slots.

Token split: each source rank splits the tokens it routes to a replicated expert into contiguous
pieces, in token order, in the proportions the plan fixed (integer weights, so every rank and every
run computes the same boundaries). The proportions come from water-filling: a replicated expert's
tokens go first to the copies on the ranks with the least other load.

Parity: a replica computes with a copy of the owner's weights (``sync_weights`` after each optimizer
step and after a replan), and its gradient is sent back and added to the owner's (``reduce_grads``
before the optimizer step), so the owner sees the gradient of every token routed to its expert and
the optimizer (and its state) stays with the owner only: training equals the run without replicas
up to the order of floating-point sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.expert._comm import _comm_device, experts_per_rank

# coordinate-descent sweeps over the replicated experts' splits; the loads settle in a few
_REFINE_SWEEPS = 8


@dataclass(frozen=True)
class ReplicaPlan:
    """Where every expert's copies live and how its tokens are shared between them.

    Slots are ordered by rank: rank d computes slots ``sum(placement[:d])`` .. ``+ placement[d]``,
    first the experts it owns (in expert order), then its replicas (in expert order, hence grouped by
    owner rank)."""

    num_experts: int
    ep_size: int
    slot_expert: tuple[int, ...]           # E + R: the expert each slot computes
    placement: tuple[int, ...]             # slots per rank (the dispatcher's ``placement``)
    copies: tuple[tuple[int, ...], ...]    # per expert: its slots, the owner's first, then in planning order
    weights: tuple[tuple[int, ...], ...]   # per expert: the share of its tokens for each copy (integers)
    tokens_per_expert: tuple[int, ...]     # the measured counts the plan was built from

    @property
    def num_slots(self) -> int:
        return len(self.slot_expert)

    @property
    def num_replicas(self) -> int:
        return self.num_slots - self.num_experts

    def slot_rank(self, slot: int) -> int:
        return _slot_rank(self.placement, slot)

    def owner(self, expert: int) -> int:
        return expert // (self.num_experts // self.ep_size)

    def replicas(self) -> list[tuple[int, int, int]]:
        """(slot, expert, rank) of every replica, in slot order."""
        return [(s, e, self.slot_rank(s)) for e, slots in enumerate(self.copies) for s in slots[1:]]

    def local_replicas(self, rank: int) -> list[int]:
        """The experts rank ``rank`` holds replicas of, in its slot order."""
        return sorted(e for _, e, d in self.replicas() if d == rank)

    def expected_load(self) -> list[float]:
        """Tokens per rank the measured counts give under this plan."""
        load = [0.0] * self.ep_size
        for e, (slots, weights) in enumerate(zip(self.copies, self.weights)):
            total = sum(weights)
            for slot, w in zip(slots, weights):
                load[self.slot_rank(slot)] += self.tokens_per_expert[e] * w / total
        return load

    def owner_load(self) -> list[int]:
        """Tokens per rank the measured counts give without replicas."""
        per_rank = self.num_experts // self.ep_size
        return [sum(self.tokens_per_expert[d * per_rank:(d + 1) * per_rank]) for d in range(self.ep_size)]


def identity_plan(num_experts: int, ep_size: int, tokens_per_expert=None) -> ReplicaPlan:
    """No replicas: slot e is expert e on its owner (the plain even placement)."""
    counts = tuple(int(c) for c in tokens_per_expert) if tokens_per_expert is not None else (0,) * num_experts
    return ReplicaPlan(num_experts, ep_size, tuple(range(num_experts)),
                       tuple(experts_per_rank(num_experts, ep_size)), tuple((e,) for e in range(num_experts)),
                       tuple((1,) for _ in range(num_experts)), counts)


def max_replicas(num_experts: int, ep_size: int) -> int:
    """At most one copy of an expert per rank: E * (P - 1) replicas."""
    return num_experts * (ep_size - 1)


def _check(num_experts: int, ep_size: int, replicas: int) -> None:
    experts_per_rank(num_experts, ep_size)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"hot-expert replicas must be an integer >= 0, got {replicas!r}")
    if replicas > max_replicas(num_experts, ep_size):
        raise ValueError(f"hot-expert replicas={replicas}: at most {max_replicas(num_experts, ep_size)} with "
                         f"{num_experts} experts on {ep_size} expert-parallel ranks (one copy of an expert per rank)")


def _water_fill(amount: float, base: list[float]) -> list[float]:
    """Split ``amount`` over bins already holding ``base`` so the fullest ones get nothing and the
    others end level (the split minimising the largest bin)."""
    order = sorted(range(len(base)), key=lambda i: (base[i], i))
    level, used = 0.0, 0
    for k in range(1, len(order) + 1):
        # level reachable filling the k lowest bins with everything
        candidate = (amount + sum(base[i] for i in order[:k])) / k
        level, used = candidate, k
        if k == len(order) or candidate <= base[order[k]]:
            break
    share = [0.0] * len(base)
    for i in order[:used]:
        share[i] = max(0.0, level - base[i])
    return share


def _integer_shares(amount: int, shares: list[float]) -> list[int]:
    """Integer weights proportional to ``shares`` summing to ``amount`` (largest remainder, ties to
    the earlier copy); equal weights when there is nothing to share."""
    if amount <= 0 or sum(shares) <= 0:
        return [1] * len(shares)
    scale = amount / sum(shares)
    exact = [s * scale for s in shares]
    floors = [math.floor(x) for x in exact]
    rest = amount - sum(floors)
    for i in sorted(range(len(exact)), key=lambda i: (floors[i] - exact[i], i))[:rest]:
        floors[i] += 1
    return floors


def plan_replicas(tokens_per_expert, ep_size: int, replicas: int) -> ReplicaPlan:
    """The replica plan for measured ``tokens_per_expert`` (E counts, summed over the EP group).

    One replica at a time: the expert with the most tokens per copy gets it (ties: the lower expert),
    so the R most loaded experts get one each unless one is hot enough to deserve a second; it goes to
    the rank with the least load that holds no copy of that expert (ties: the lower rank; never the
    owner). Pure and deterministic: the same counts give the same plan on every rank."""
    counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                              else tokens_per_expert)]
    num_experts = len(counts)
    _check(num_experts, ep_size, replicas)
    if any(c < 0 for c in counts):
        raise ValueError(f"token counts per expert must be >= 0, got {counts}")
    per_rank = num_experts // ep_size
    ranks = [[e // per_rank] for e in range(num_experts)]          # per expert: ranks of its copies
    shares = [[float(c)] for c in counts]                          # per expert: tokens per copy

    load = [0.0] * ep_size                                         # tokens per rank, kept current
    for e in range(num_experts):
        load[ranks[e][0]] += shares[e][0]

    def refill(e: int) -> None:
        for d, s in zip(ranks[e], shares[e]):
            load[d] -= s
        shares[e] = _water_fill(float(counts[e]), [load[d] for d in ranks[e]])
        for d, s in zip(ranks[e], shares[e]):
            load[d] += s

    for _ in range(replicas):
        e = max((e for e in range(num_experts) if len(ranks[e]) < ep_size),
                key=lambda e: (counts[e] / len(ranks[e]), -e))
        target = min((d for d in range(ep_size) if d not in ranks[e]), key=lambda d: (load[d], d))
        ranks[e].append(target)
        shares[e].append(0.0)
        # re-level every replicated expert, so the next pick sees the loads this one leaves
        replicated = sorted((r for r in range(num_experts) if len(ranks[r]) > 1), key=lambda r: (-counts[r], r))
        for _ in range(_REFINE_SWEEPS):
            for r in replicated:
                refill(r)

    # slots: per rank its own experts, then its replicas in expert order
    slot_expert, placement, slot_of = [], [], {}
    for d in range(ep_size):
        owned = list(range(d * per_rank, (d + 1) * per_rank))
        hosted = [e for e in range(num_experts) if d in ranks[e][1:]]
        for e in owned + hosted:
            slot_of[e, d] = len(slot_expert)
            slot_expert.append(e)
        placement.append(len(owned) + len(hosted))
    copies = tuple(tuple(slot_of[e, d] for d in ranks[e]) for e in range(num_experts))
    weights = tuple(tuple(_integer_shares(counts[e], shares[e])) if len(shares[e]) > 1 else (1,)
                    for e in range(num_experts))
    return ReplicaPlan(num_experts, ep_size, tuple(slot_expert), tuple(placement), copies, weights, tuple(counts))


def _slot_rank(placement, slot: int) -> int:
    start = 0
    for rank, count in enumerate(placement):
        if slot < start + count:
            return rank
        start += count
    raise IndexError(f"slot {slot} out of range for placement {list(placement)}")


# ---------------------------------------------------------------------------------- routing
def route_to_slots(plan: ReplicaPlan, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
    """[T, E] routing map (and probabilities) -> [T, E + R] over the plan's slots: each routed copy
    goes to exactly one slot computing its expert; a replicated expert's tokens are cut into
    contiguous pieces in token order, piece k of size ``n * W_k // W`` for n tokens (cumulative
    integer weights), so the split needs no communication and is the same every time.
    ``probs`` keep their gradient (a gather of the router's probabilities)."""
    if routing_map.dim() != 2 or routing_map.shape[1] != plan.num_experts:
        raise ValueError(f"route_to_slots: routing_map [T, {plan.num_experts}] expected, "
                         f"got {tuple(routing_map.shape)}")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"route_to_slots: routing_map must be bool, got {routing_map.dtype}")
    device = routing_map.device
    slot_expert = torch.tensor(plan.slot_expert, dtype=torch.int64, device=device)
    owner_slots = torch.tensor([c[0] for c in plan.copies], dtype=torch.int64, device=device)
    out = routing_map.new_zeros(routing_map.shape[0], plan.num_slots)
    out.index_copy_(1, owner_slots, routing_map)
    for e, (slots, weights) in enumerate(zip(plan.copies, plan.weights)):
        if len(slots) == 1:
            continue
        column = routing_map[:, e]
        position = torch.cumsum(column.to(torch.int64), 0) - 1     # rank of the token among e's
        cumulative = torch.tensor([sum(weights[:k + 1]) for k in range(len(weights) - 1)], dtype=torch.int64,
                                  device=device)
        # n * W_k // W on the device: no host synchronisation per replicated expert
        bounds = torch.div(column.sum() * cumulative, sum(weights), rounding_mode="floor")
        piece = torch.searchsorted(bounds, position, right=True)
        for k, slot in enumerate(slots):
            out[:, slot] = column & (piece == k)
    if probs is None:
        return out, None
    if probs.shape != routing_map.shape:
        raise ValueError(f"route_to_slots: probs {tuple(probs.shape)} and routing_map "
                         f"{tuple(routing_map.shape)} differ")
    gathered = probs.index_select(1, slot_expert)
    return out, torch.where(out, gathered, torch.zeros((), dtype=probs.dtype, device=device))


def rank_loads(slot_counts, placement) -> list[int]:
    """Rows each rank computes, from rows per slot summed over the sources."""
    counts = slot_counts.tolist() if torch.is_tensor(slot_counts) else list(slot_counts)
    loads, start = [], 0
    for count in placement:
        loads.append(int(sum(counts[start:start + count])))
        start += count
    return loads


def imbalance(loads) -> float:
    """max / mean of per-rank loads (1.0 is perfect balance; 1.0 too when nothing was routed)."""
    loads = list(loads)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


# ---------------------------------------------------------------------------------- manager
class HotExpertReplicas:
    """Hot-expert replicas for one MoE layer on an EP group.

    Per step::

        mgr.observe(routing_map.sum(0))                  # this rank's tokens per expert
        slot_map, slot_probs = mgr.route(routing_map, probs)
        # dispatch with placement=mgr.placement; the experts use mgr.local_weights(expert_params)
        loss.backward()
        mgr.reduce_grads(expert_params)                  # replica gradients added to the owners'
        optimizer.step()                                 # owners only: replicas have no state
        mgr.step()                                       # every ``interval`` steps: a new plan
        mgr.sync_weights(expert_params)                  # owners' new weights to the replicas

    ``expert_params``: this rank's expert parameters, each [E_local, ...] (one row per owned expert);
    ``bind`` (done by ``attach_replicas``) lets the three methods find them themselves.
    ``count_group``: where the counts are summed before planning (default ``ep_group``); it must span
    every rank that has to share the placement — under expert tensor parallel, the ETP peers too.
    Until the first plan (``interval`` steps of counts) there are no replicas."""

    def __init__(self, num_experts: int, ep_group=None, *, replicas: int = 1, interval: int = 100,
                 count_group=None):
        self.group = ep_group
        self.count_group = ep_group if count_group is None else count_group
        self._params_fn = None
        self.ep_size = dist.get_world_size(ep_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(ep_group) if dist.is_initialized() else 0
        _check(num_experts, self.ep_size, replicas)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"replica interval must be an integer >= 1 step, got {interval!r}")
        self.num_experts, self.replicas, self.interval = num_experts, replicas, interval
        self.plan = identity_plan(num_experts, self.ep_size)
        # this rank's counts since the last plan: per expert (observe) and per slot as routed (route);
        # kept where the router's tensors are, so a step adds no host synchronisation
        self._window: torch.Tensor | None = None
        self._slot_window: torch.Tensor | None = None
        self._steps = 0
        self._replica_weights: list[torch.Tensor] = []
        self._report = self._make_report([0] * num_experts, None, self.plan, self.plan)

    # -------------------------------------------------------------------- plan
    @property
    def placement(self) -> list[int]:
        return list(self.plan.placement)

    @property
    def num_slots(self) -> int:
        return self.plan.num_slots

    def observe(self, tokens_per_expert) -> None:
        """Add this rank's tokens per expert (E counts, one forward) to the window."""
        counts = torch.as_tensor(tokens_per_expert).detach().reshape(-1)
        if counts.numel() != self.num_experts:
            raise ValueError(f"observe: {self.num_experts} token counts expected, got {counts.numel()}")
        counts = counts.to(torch.int64)
        self._window = counts.clone() if self._window is None else self._window + counts.to(self._window.device)

    def step(self) -> bool:
        """Count one optimizer step; every ``interval`` steps replan. True when the plan was rebuilt
        (then ``sync_weights`` must run before the next forward; calling it every step does)."""
        self._steps += 1
        if self._steps % self.interval:
            return False
        self.replan()
        return True

    def replan(self) -> ReplicaPlan:
        """A new plan from the window's counts summed over the EP group (one all-reduce: every rank
        calls it); the window starts again."""
        device = _comm_device(self.count_group) if dist.is_initialized() else torch.device("cpu")
        experts = self._window if self._window is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        slots = self._slot_window
        if slots is None:
            slots = torch.full((self.plan.num_slots,), -1, dtype=torch.int64)   # nothing routed: no measure
        window = torch.cat([experts.to(device), slots.to(device)])
        if dist.is_initialized() and dist.get_world_size(self.count_group) > 1:
            dist.all_reduce(window, group=self.count_group)
        window = window.cpu()
        counts, routed = window[:self.num_experts], window[self.num_experts:]
        old, self.plan = self.plan, plan_replicas(counts, self.ep_size, self.replicas)
        self._report = self._make_report(counts.tolist(), routed if self._slot_window is not None else None,
                                         old, self.plan)
        self._window = self._slot_window = None
        self._replica_weights = []
        return self.plan

    def route(self, routing_map: torch.Tensor, probs: torch.Tensor | None = None):
        """``route_to_slots`` with the current plan (the rows per slot are counted for the report)."""
        slot_map, slot_probs = route_to_slots(self.plan, routing_map, probs)
        routed = slot_map.sum(0)
        self._slot_window = routed if self._slot_window is None else self._slot_window + routed
        return slot_map, slot_probs

    def _make_report(self, counts, routed, old: ReplicaPlan, new: ReplicaPlan) -> dict:
        before = identity_plan(self.num_experts, self.ep_size, counts).owner_load()
        after = rank_loads(routed, old.placement) if routed is not None else before
        planned = new.expected_load()   # new was planned from these counts
        return {"tokens_per_expert": list(counts), "before": before, "after": after, "planned": planned,
                "before_max_over_mean": imbalance(before), "after_max_over_mean": imbalance(after),
                "planned_max_over_mean": imbalance(planned), "replicas": new.replicas()}

    def load_report(self) -> dict:
        """Rows per rank over the last window (the ``interval`` steps before the last replan), summed
        over the EP group: ``before`` as the even placement would have had them, ``after`` as the
        ranks really received them under the plan that served the window, ``planned`` what the new
        plan would give the same counts; each with its max/mean, and the new plan's replicas as
        (slot, expert, rank). The same on every rank (log it from one)."""
        return dict(self._report)

    # -------------------------------------------------------------------- weights and gradients
    def _layout(self):
        """Rows to send per destination (my experts replicated there, as local indices) and rows
        received per source (my replicas of its experts), both in slot order."""
        per_rank = self.num_experts // self.ep_size
        send = [[e - self.rank * per_rank for e in self.plan.local_replicas(d) if self.plan.owner(e) == self.rank]
                for d in range(self.ep_size)]
        mine = self.plan.local_replicas(self.rank)
        recv = [sum(1 for e in mine if self.plan.owner(e) == s) for s in range(self.ep_size)]
        return send, recv

    def bind(self, params_fn) -> None:
        """``params_fn()`` returns the expert parameters; the methods below then need no argument."""
        self._params_fn = params_fn

    def _check_params(self, expert_params) -> list[torch.Tensor]:
        if expert_params is None:
            if self._params_fn is None:
                raise ValueError("HotExpertReplicas: pass the expert parameters (or bind them first)")
            expert_params = self._params_fn()
        params = list(expert_params)
        per_rank = self.num_experts // self.ep_size
        for p in params:
            if p.dim() < 1 or p.shape[0] != per_rank:
                raise ValueError(f"expert parameters must be [{per_rank}, ...] (one row per local expert), "
                                 f"got {tuple(p.shape)}")
        return params

    def sync_weights(self, expert_params=None) -> None:
        """Copy the owners' current weights into this rank's replicas (one all-to-all per parameter)."""
        params = self._check_params(expert_params)
        send, recv = self._layout()
        replicas = []
        with torch.no_grad():
            for p in params:
                flat = p.detach().reshape(p.shape[0], -1)
                index = torch.tensor([i for rows in send for i in rows], dtype=torch.int64, device=p.device)
                out = flat.new_empty(sum(recv), flat.shape[1])
                if self.ep_size > 1 and self.plan.num_replicas:
                    dist.all_to_all_single(out, flat.index_select(0, index).contiguous(), recv,
                                           [len(rows) for rows in send], group=self.group)
                replicas.append(out.reshape(sum(recv), *p.shape[1:]).requires_grad_(p.requires_grad))
        self._replica_weights = replicas

    def local_weights(self, expert_params=None) -> list[torch.Tensor]:
        """Each parameter extended by this rank's replicas: [placement[rank], ...], in slot order (what
        the experts compute with; the gradient reaches the owned rows and the replicas apart)."""
        params = self._check_params(expert_params)
        if not self.plan.local_replicas(self.rank):
            return params
        if len(self._replica_weights) != len(params):
            raise RuntimeError("HotExpertReplicas: sync_weights must run after a new plan, before the forward")
        return [torch.cat([p, r]) for p, r in zip(params, self._replica_weights)]

    def reduce_grads(self, expert_params=None, grad_attr: str = "grad") -> None:
        """Send every replica's gradient to the owner and add it to the owner's ``grad_attr``
        (``"main_grad"`` for megatron's DDP buffers), in source-rank order; the replicas' gradients
        are cleared. A collective: every rank calls it after the backward."""
        params = self._check_params(expert_params)
        if self.plan.num_replicas == 0 or self.ep_size == 1:
            return
        send, recv = self._layout()
        for i, p in enumerate(params):
            mine = self._replica_weights[i] if i < len(self._replica_weights) else None
            width = p[0].numel()
            grad = None if mine is None else mine.grad
            out_rows = grad.reshape(sum(recv), width) if grad is not None else p.new_zeros(sum(recv), width)
            incoming = p.new_empty(sum(len(rows) for rows in send), width)
            dist.all_to_all_single(incoming, out_rows.contiguous(), [len(rows) for rows in send], recv,
                                   group=self.group)
            if mine is not None:
                mine.grad = None
            if not incoming.numel():
                continue
            index = torch.tensor([i for rows in send for i in rows], dtype=torch.int64, device=p.device)
            target = getattr(p, grad_attr, None)
            if target is None:
                target = torch.zeros_like(p)
                setattr(p, grad_attr, target)
            target.view(p.shape[0], width).index_add_(0, index, incoming.to(target.dtype))


# ---------------------------------------------------------------------------------- the MoE block
class _ReplicaDispatcher:
    """The block's dispatcher seen through the plan: counts observed, the map routed over slots, and
    an ``AllToAllDispatcher`` over the slots with the plan's placement (rebuilt when it changes)."""

    def __init__(self, manager: HotExpertReplicas, base):
        self.manager, self.base, self._inner = manager, base, None
        self.num_experts = base.num_experts

    def dispatch(self, tokens, routing_map, probs):
        from hyper_adaptor.parallel.expert._dispatcher import AllToAllDispatcher

        self.manager.observe(routing_map.sum(0))
        slot_map, slot_probs = self.manager.route(routing_map, probs)
        if self._inner is None or self._inner.placement != self.manager.placement:
            b = self.base
            self._inner = AllToAllDispatcher(self.manager.num_slots, b.ep_group, etp_group=b.etp_group, topk=b.topk,
                                             placement=self.manager.placement)
        return self._inner.dispatch(tokens, slot_map, slot_probs)

    def combine(self, expert_out):
        return self._inner.combine(expert_out)


def attach_replicas(moe, *, replicas: int, interval: int) -> HotExpertReplicas:
    """Hot-expert replicas on a ``MoE`` block already sharded by ``ExpertParallel`` /
    ``ExpertTensorParallel``: its dispatcher routes over the plan's slots and its experts compute the
    replicas' rows with the replicas' weights. Returns the manager, bound to the block's expert
    weights; the training loop calls ``reduce_grads()`` after the backward, ``step()`` and
    ``sync_weights()`` after the optimizer step. Dropless dispatch only: a capacity counted per slot
    would drop other tokens than the block without replicas."""
    from hyper_adaptor.parallel.expert._experts import GroupedExperts

    dispatcher, experts = getattr(moe, "dispatcher", None), getattr(moe, "experts", None)
    if isinstance(dispatcher, _ReplicaDispatcher):
        raise ValueError("attach_replicas: the block already has replicas")
    if not isinstance(experts, GroupedExperts) or not hasattr(dispatcher, "ep_group"):
        raise TypeError(f"attach_replicas applies to a MoE block, got {type(moe).__name__}")
    if dispatcher.capacity_factor is not None:
        raise ValueError(f"hot-expert replicas need dropless dispatch; the block has capacity_factor="
                         f"{dispatcher.capacity_factor}")
    if dispatcher.ep_group is None:
        raise ValueError("attach_replicas: the block is not expert-parallel (shard it with ExpertParallel first)")
    if dispatcher.placement != experts_per_rank(dispatcher.num_experts, len(dispatcher.placement)):
        raise ValueError(f"hot-expert replicas plan their own placement; the block has {dispatcher.placement}")
    count_group = None
    if dispatcher.etp_group is not None and dist.get_world_size(dispatcher.etp_group) > 1:
        count_group = dist.group.WORLD     # ETP peers sit in other EP groups and must share the plan
    manager = HotExpertReplicas(dispatcher.num_experts, dispatcher.ep_group, replicas=replicas, interval=interval,
                                count_group=count_group)
    manager.bind(lambda: list(experts.projections().values()))
    moe.dispatcher = _ReplicaDispatcher(manager, dispatcher)
    grouped_forward = type(experts).forward

    def forward(x, tokens_per_expert):
        # the class's arithmetic on [local + replica] weights: same names, more rows
        names = list(experts.projections())
        local = dict(zip(names, manager.local_weights()))
        view = _WeightsView(experts, local, len(tokens_per_expert))
        return grouped_forward(view, x, tokens_per_expert)

    experts.forward = forward
    return manager


class _WeightsView:
    """A stand-in ``self`` for ``GroupedExperts.forward``: the module's attributes, with the local
    weights extended by the replicas and the slot count."""

    def __init__(self, module, weights: dict, num_experts: int):
        self._module, self._weights, self.num_experts = module, weights, num_experts

    def __getattr__(self, name):
        if name in self._weights:
            return self._weights[name]
        return getattr(self._module, name)


# ---------------------------------------------------------------------------------- skewed router
def zipf_bias(num_experts: int, exponent: float = 1.0) -> torch.Tensor:
    """Router logit bias making expert e's score ~ (e + 1) ** -exponent: a Zipf-skewed router whose
    hottest experts all sit on the first EP rank (the worst case for an even placement)."""
    return -exponent * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))


def skewed_routing(tokens: int, num_experts: int, topk: int, exponent: float, generator) -> torch.Tensor:
    """A top-k routing map [T, E] from standard normal logits plus ``zipf_bias``."""
    logits = torch.randn(tokens, num_experts, generator=generator) + zipf_bias(num_experts, exponent)
    top = logits.topk(topk, dim=1).indices
    return torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)


def skewed_load_report(num_ranks: int = 4, num_experts: int = 8, topk: int = 2, replicas: int = 4,
                       exponent: float = 1.0, tokens_per_rank: int = 4096, window: int = 4, steps: int = 4,
                       seed: int = 0) -> dict:
    """Max / mean tokens per EP rank on a Zipf-skewed router, without and with replicas.

    ``num_ranks`` source ranks each route ``tokens_per_rank`` tokens per step (one process, the same
    arithmetic the dispatcher does with the plan's placement: the rows a rank computes are the rows
    every source routes to its slots). The plan is built from ``window`` steps of counts and measured
    on the ``steps`` steps after them (fresh tokens)."""
    generator = torch.Generator().manual_seed(seed)

    def batch():
        return [skewed_routing(tokens_per_rank, num_experts, topk, exponent, generator) for _ in range(num_ranks)]

    observed = torch.zeros(num_experts, dtype=torch.int64)
    for _ in range(window):
        observed += sum(m.sum(0) for m in batch())
    plan = plan_replicas(observed, num_ranks, replicas)
    base = identity_plan(num_experts, num_ranks)
    before, after = [0] * num_ranks, [0] * num_ranks
    for _ in range(steps):
        maps = batch()
        for tally, p in ((before, base), (after, plan)):
            slot_counts = sum(route_to_slots(p, m)[0].sum(0) for m in maps)
            for d, load in enumerate(rank_loads(slot_counts, p.placement)):
                tally[d] += load
    return {"num_ranks": num_ranks, "num_experts": num_experts, "topk": topk, "replicas": replicas,
            "zipf_exponent": exponent, "tokens_per_rank": tokens_per_rank,
            "tokens_per_expert": observed.tolist(), "placement": list(plan.placement),
            "replica_experts": [(e, d) for _, e, d in plan.replicas()],
            "load_before": before, "load_after": after,
            "max_over_mean_before": imbalance(before), "max_over_mean_after": imbalance(after),
            "planned_max_over_mean": imbalance(plan.expected_load())}
