"""Tenant quotas: how much each tenant may send, checked when a request is admitted and settled when it ends.

The admit stage asks :meth:`TenantLedger.reserve` before the engine queues a request. Every check runs before
anything is taken, so a refused request (429 :class:`RateLimitedError` naming the quota, 503
:class:`OverloadedError` when the tenant's queue is full, 400 when the request could never fit) leaves the
ledger as it was. An admitted request carries a :class:`QuotaHold`; the engine cancels it if a later request
stage rejects the request, and settles it exactly once when the request finishes or is aborted.

Quotas (each ``None``: no limit):

* ``requests_per_minute`` / ``tokens_per_minute`` — token buckets holding a minute's worth, refilled
  continuously. A request takes one request and ``prompt + max_tokens`` tokens (capped by the context) when it
  is admitted; when it ends, the tokens it did not use come back.
* ``max_concurrent`` — requests in flight (queued or running); ``max_queued`` — requests waiting for a batch
  slot.
* ``max_spend`` per ``spend_window_s`` — a bucket of money refilled over the window. A request's price is known
  only once select_tier has chosen its tier and it has run, so its actual cost (its CostRecord's ``monetary``)
  is charged when it ends, and new requests are admitted while the bucket is not used up: the requests already
  in flight can overshoot the cap by at most their own cost.

A request that ends before any of its tokens were computed (aborted while queued: its client left) is refunded
in full, and so is a choice aborted because a sibling choice of its API request was refused, even if it had
started (``Engine.abort(..., refund=True)`` cancels its holds). Tenants not named in the config have no quota
(weight 1).
All methods but ``check_group`` (which reads only the policies) run under the engine lock (request stages,
finishing and aborting hold it), so there is no lock here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from litellm_pipeline.errors import (
    InvalidRequestError,
    OverloadedError,
    RateLimitedError,
)

if TYPE_CHECKING:
    from litellm_pipeline.engine.request import Request

__all__ = ["QUOTAS", "QuotaHold", "TenantLedger", "TenantPolicy", "TokenBucket", "reserved_tokens"]

QUOTAS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queued", "max_spend")
_BUCKETS = {"requests_per_minute": "requests", "tokens_per_minute": "tokens", "max_spend": "spend"}
_BUSY_RETRY_S = 1.0  # what to tell a tenant at its concurrency or queue cap: one of its requests must end first


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's fair-share weight and quotas (plain values; built from ``conf/tenants`` by the builder)."""

    name: str
    weight: float = 1.0
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    max_spend: float | None = None
    spend_window_s: float = 3600.0
    max_kv_fraction: float | None = None  # the scheduler's KV shares (engine/scheduler.py), not the ledger's
    min_kv_fraction: float | None = None


class TokenBucket:
    """``capacity`` units, refilled at ``rate`` per second. ``level`` may go below zero: a cost charged after
    the fact (money) is owed, and nothing more is admitted until the refill has paid it back."""

    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity, self.rate, self.level, self.stamp = capacity, rate, capacity, now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` can be taken (0: now); call :meth:`refill` first."""
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class _Tenant:
    """The live state of one configured tenant: its buckets and its requests in flight."""

    __slots__ = ("policy", "requests", "tokens", "spend", "in_flight")

    def __init__(self, policy: TenantPolicy, now: float):
        p = policy
        self.policy = p
        self.requests = TokenBucket(p.requests_per_minute, p.requests_per_minute / 60, now) \
            if p.requests_per_minute is not None else None
        self.tokens = TokenBucket(p.tokens_per_minute, p.tokens_per_minute / 60, now) \
            if p.tokens_per_minute is not None else None
        self.spend = TokenBucket(p.max_spend, p.max_spend / p.spend_window_s, now) if p.max_spend is not None else None
        self.in_flight = 0

    def refill(self, now: float) -> None:
        for bucket in (self.requests, self.tokens, self.spend):
            if bucket is not None:
                bucket.refill(now)


class QuotaHold:
    """What one admitted request took from its tenant: ``cancel()`` gives it all back (a later request stage
    rejected the request), ``settle(req)`` when the request ends (unused tokens back, its cost charged). Only
    the first of them counts."""

    __slots__ = ("_ledger", "_tenant", "_tokens", "_open")

    def __init__(self, ledger: TenantLedger, tenant: _Tenant, tokens: int):
        self._ledger, self._tenant, self._tokens, self._open = ledger, tenant, tokens, True

    def cancel(self) -> None:
        if self._open:
            self._open = False
            self._ledger._release(self._tenant, self._tokens, refund_request=True)

    def settle(self, req: Request) -> None:
        if not self._open:
            return
        self._open = False
        ran = bool(req.output_ids) or req.num_computed > 0
        if not ran:  # ended while queued: nothing of it was computed
            self._ledger._release(self._tenant, self._tokens, refund_request=True)
            return
        used = len(req.prompt_ids) + len(req.output_ids)
        self._ledger._release(self._tenant, max(0, self._tokens - used), refund_request=False, cost=_cost_of(req))


def reserved_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """The tokens a request takes from its tenant's ``tokens_per_minute`` when admitted: prompt + max_tokens,
    capped by the context."""
    return min(prompt_len + max_tokens, max_model_len)


def _cost_of(req: Request) -> float:
    """The request's money: its cost record's when it finished, else its tier's price of what it computed."""
    if req.cost is not None and req.cost.monetary is not None:
        return req.cost.monetary
    if req.tierset is not None:
        return req.tierset.price.of(len(req.prompt_ids), len(req.output_ids))
    return 0.0


class TenantLedger:
    """The quotas of the configured tenants (``policies``: name -> :class:`TenantPolicy`)."""

    def __init__(self, policies: Mapping[str, TenantPolicy], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self._tenants = {name: _Tenant(p, now) for name, p in policies.items()}

    @property
    def weights(self) -> dict[str, float]:
        return {name: t.policy.weight for name, t in self._tenants.items()}

    def in_flight(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return t.in_flight if t is not None else 0

    def level(self, tenant: str, quota: str) -> float | None:
        """What is left now in one of a tenant's buckets (``requests_per_minute``, ``tokens_per_minute``,
        ``max_spend``); None if it has no such quota."""
        t = self._tenants.get(tenant)
        bucket = getattr(t, _BUCKETS[quota], None) if t is not None else None
        if bucket is None:
            return None
        bucket.refill(self.clock())
        return bucket.level

    def check_group(self, tenant: str, tokens: Sequence[int], prompts: int = 1) -> None:
        """Raise InvalidRequestError (a 400: no wait would help) if the engine requests of one API request
        (``prompts`` prompts × n choices, admitted one by one; ``tokens``: each one's prompt + max_tokens, see
        :func:`reserved_tokens`) could never all be admitted together under ``tenant``'s quotas. A request that
        could not even be admitted alone is left to :meth:`reserve`, which names its own field. Reads only the
        policies (no lock needed)."""
        t = self._tenants.get(tenant)
        k = len(tokens)
        if t is None or k < 2:
            return
        p, total = t.policy, sum(tokens)
        if p.tokens_per_minute is not None and max(tokens) > p.tokens_per_minute:
            return  # reserve() says which field of the one request to lower
        if p.max_concurrent is not None and k > p.max_concurrent:
            why, fix = f"its max_concurrent quota of {p.max_concurrent} requests in flight", ""
        elif p.requests_per_minute is not None and k > p.requests_per_minute:
            why, fix = f"its requests_per_minute quota of {p.requests_per_minute:g}", ""
        elif p.tokens_per_minute is not None and total > p.tokens_per_minute:
            why = (f"its tokens_per_minute quota of {p.tokens_per_minute:g}: together they need {total} tokens "
                   "(prompt + max_tokens each)")
            fix = " or lower max_tokens"
        else:
            return
        n = k // prompts
        if n == 1:
            field, what = "prompt", f"{prompts} prompts"
        else:
            field, what = "n", f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n}"
        raise InvalidRequestError(
            field, f"this request runs {k} engine requests at once ({what}), more than tenant {tenant!r} can ever "
            f"admit together under {why}: ask for fewer{fix}")

    def reserve(self, req: Request, tokens: int, waiting: Iterable[Request]) -> QuotaHold | None:
        """Check every quota of ``req.tenant`` for a request of ``tokens`` tokens (prompt + max_tokens), then
        take them; raise naming the first quota it breaks (nothing taken). ``waiting``: the scheduler's queue
        (counted only for a tenant with ``max_queued``). None for a tenant without quotas."""
        t = self._tenants.get(req.tenant)
        if t is None:
            return None
        p, name = t.policy, req.tenant
        if t.tokens is not None and tokens > t.tokens.capacity:  # no wait would help: a 400, not a 429
            n, cap = len(req.prompt_ids), p.tokens_per_minute
            if n >= cap:
                raise InvalidRequestError("prompt", f"is {n} tokens, which tenant {name!r}'s tokens_per_minute "
                                          f"quota of {cap:g} cannot take with any output: shorten it")
            raise InvalidRequestError(
                "params.max_tokens", f"the prompt ({n} tokens) + max_tokens ({tokens - n}) = {tokens} tokens exceeds "
                f"tenant {name!r}'s tokens_per_minute quota of {cap:g}, so it could never be admitted: lower "
                f"max_tokens to at most {int(cap) - n}")
        if p.max_concurrent is not None and t.in_flight >= p.max_concurrent:
            raise RateLimitedError(
                f"tenant {name!r} is over its max_concurrent quota: {t.in_flight} requests in flight (at most "
                f"{p.max_concurrent}); retry when one has finished", _BUSY_RETRY_S, "max_concurrent")
        if p.max_queued is not None:
            queued = sum(1 for r in waiting if r.tenant == name)
            if queued >= p.max_queued:
                raise OverloadedError(
                    f"tenant {name!r}'s queue is full: {queued} requests wait for a batch slot (max_queued "
                    f"{p.max_queued}); retry later", _BUSY_RETRY_S, "max_queued")
        t.refill(self.clock())
        if t.requests is not None and (wait := t.requests.wait_s(1)) > 0:
            raise RateLimitedError(
                f"tenant {name!r} is over its requests_per_minute quota ({p.requests_per_minute:g}); retry in "
                f"{wait:.1f} s", wait, "requests_per_minute")
        if t.tokens is not None and (wait := t.tokens.wait_s(tokens)) > 0:
            raise RateLimitedError(
                f"tenant {name!r} is over its tokens_per_minute quota ({p.tokens_per_minute:g}): this request "
                f"needs {tokens} tokens (prompt + max_tokens) and {max(0.0, t.tokens.level):.0f} are left; retry "
                f"in {wait:.1f} s", wait, "tokens_per_minute")
        if t.spend is not None and t.spend.level <= 0:
            wait = -t.spend.level / t.spend.rate + 1e-3  # until the refill has paid back what is owed
            raise RateLimitedError(
                f"tenant {name!r} has used up its max_spend quota ({p.max_spend:g} monetary units per "
                f"{p.spend_window_s:g} s); retry in {wait:.1f} s", wait, "max_spend")
        if t.requests is not None:
            t.requests.take(1)
        if t.tokens is not None:
            t.tokens.take(tokens)
        t.in_flight += 1
        return QuotaHold(self, t, tokens)

    def _release(self, t: _Tenant, tokens: int, refund_request: bool, cost: float = 0.0) -> None:
        t.in_flight -= 1
        now = self.clock()
        t.refill(now)
        if refund_request and t.requests is not None:
            t.requests.give(1)
        if t.tokens is not None and tokens:
            t.tokens.give(tokens)
        if t.spend is not None and cost:
            t.spend.take(cost)
