"""Per-key rate limits: requests and tokens per minute, in this process or in Redis.

Each limited key has two fixed one-minute windows, one for requests and one for tokens,
each starting at the key's first use after the previous one ended (so servers need no shared
clock: in Redis the window is the counter's own expiry). A request is admitted while the
key's requests in the window are under requests_per_minute (counting it, atomically: no two
concurrent requests can both take the last slot) and its tokens under tokens_per_minute.
Tokens (prompt + completion) are charged when the response ends, so concurrent requests may
together pass the token limit by what they were generating; the next request then waits
for the window to end.

Backends: `MemoryRateLimiter` (one event loop: a check and its increment run with no await
between them) and `RedisRateLimiter` (`--rate-limit-backend redis://HOST:PORT`: one Lua
script per check, which Redis runs atomically, so replicas behind one Service share a limit).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Protocol

from jaxserve.entrypoints.openai.api_keys import APIKey

logger = logging.getLogger(__name__)

WINDOW_S = 60.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A check's outcome and the numbers for the x-ratelimit-* headers. `refused_by` is
    "requests" or "tokens" when refused; `unavailable` when the backend could not be asked
    and the fail mode is closed."""
    refused_by: str | None
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    unavailable: bool = False

    @property
    def retry_after_s(self) -> float:
        return self.reset_tokens_s if self.refused_by == "tokens" else self.reset_requests_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers (for the limits this key has)."""
        out = []
        for kind, limit, remaining, reset in (
                ("requests", self.limit_requests, self.remaining_requests,
                 self.reset_requests_s),
                ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s)):
            if limit is None:
                continue
            out += [(f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(max(0, remaining)).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), _duration(reset).encode())]
        return out


def _duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '0.5s'."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class RateLimiter(Protocol):
    async def admit(self, key: APIKey) -> Verdict:
        """Count one request of `key` if its limits allow it."""

    async def charge_tokens(self, key: APIKey, tokens: int) -> None:
        """Add a finished request's prompt + completion tokens to `key`'s window."""

    async def close(self) -> None:
        """Release connections."""


def _verdict(key: APIKey, requests: int, requests_ttl: float, tokens: int, tokens_ttl: float,
             refused_by: str | None) -> Verdict:
    rpm, tpm = key.requests_per_minute, key.tokens_per_minute
    return Verdict(refused_by,
                   rpm, None if rpm is None else rpm - requests, requests_ttl,
                   tpm, None if tpm is None else tpm - tokens, tokens_ttl)


class MemoryRateLimiter:
    """Counters in this process (the default)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[tuple[bytes, str], list[float]] = {}   # -> [count, window end]

    def _window(self, key: APIKey, kind: str, now: float, start: bool) -> list[float]:
        window = self._windows.get((key.digest, kind))
        if window is None or window[1] <= now:
            window = [0, now + WINDOW_S]
            if start:
                self._windows[(key.digest, kind)] = window
        return window

    async def admit(self, key: APIKey) -> Verdict:
        now = self.clock()
        if len(self._windows) > 4096:          # forget windows that have ended
            self._windows = {k: w for k, w in self._windows.items() if w[1] > now}
        requests = self._window(key, "requests", now, start=True)
        tokens = self._window(key, "tokens", now, start=True)
        refused_by = None
        if key.requests_per_minute is not None and requests[0] >= key.requests_per_minute:
            refused_by = "requests"
        elif key.tokens_per_minute is not None and tokens[0] >= key.tokens_per_minute:
            refused_by = "tokens"
        else:
            requests[0] += 1
        return _verdict(key, int(requests[0]), requests[1] - now, int(tokens[0]),
                        tokens[1] - now, refused_by)

    async def charge_tokens(self, key: APIKey, tokens: int) -> None:
        if key.tokens_per_minute is not None and tokens > 0:
            self._window(key, "tokens", self.clock(), start=True)[0] += tokens

    async def close(self) -> None:
        pass


# KEYS: requests counter, tokens counter. ARGV: rpm (-1: none), tpm (-1: none), window ms.
# Returns {code, requests, requests pttl, tokens, tokens pttl}; code 1 admitted, 0 refused by
# requests, -1 refused by tokens. A window starts (PEXPIRE) with its key's first count.
_ADMIT = """
local rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local code = 1
if rpm >= 0 and requests >= rpm then code = 0
elseif tpm >= 0 and tokens >= tpm then code = -1
else
  requests = redis.call('INCR', KEYS[1])
  if requests == 1 then redis.call('PEXPIRE', KEYS[1], window) end
end
local rttl, tttl = redis.call('PTTL', KEYS[1]), redis.call('PTTL', KEYS[2])
if rttl < 0 then rttl = window end
if tttl < 0 then tttl = window end
return {code, requests, rttl, tokens, tttl}
"""

_CHARGE = """
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return total
"""


class RedisRateLimiter:
    """Counters in Redis, shared by every server that names it (`redis://HOST:PORT[/DB]`).

    When Redis cannot be reached: fail_open admits the request unlimited, else it is
    refused with 503 (Verdict.unavailable). One error line per outage, one info line when
    Redis answers again."""

    def __init__(self, url: str, fail_open: bool = False, prefix: str = "jaxserve:ratelimit",
                 timeout_s: float = 1.0) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.fail_open = fail_open
        self.prefix = prefix
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s)
        self._admit = self.client.register_script(_ADMIT)
        self._charge = self.client.register_script(_CHARGE)
        self._down = False

    def _keys(self, key: APIKey) -> list[str]:
        ident = key.digest.hex()[:32]
        return [f"{self.prefix}:{ident}:requests", f"{self.prefix}:{ident}:tokens"]

    def _outage(self, exc: Exception) -> None:
        if not self._down:
            self._down = True
            logger.error("rate-limit backend %s unreachable (%s): %s", self.url,
                         type(exc).__name__,
                         "admitting limited keys' requests unlimited (--rate-limit-fail-mode "
                         "open)" if self.fail_open else "refusing limited keys' requests with "
                         "503 (--rate-limit-fail-mode closed)")

    def _recovered(self) -> None:
        if self._down:
            self._down = False
            logger.info("rate-limit backend %s reachable again", self.url)

    async def admit(self, key: APIKey) -> Verdict:
        import redis.exceptions

        rpm = -1 if key.requests_per_minute is None else key.requests_per_minute
        tpm = -1 if key.tokens_per_minute is None else key.tokens_per_minute
        try:
            code, requests, rttl, tokens, tttl = await self._admit(
                keys=self._keys(key), args=[rpm, tpm, int(WINDOW_S * 1000)])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                OSError) as exc:
            self._outage(exc)
            return Verdict(None) if self.fail_open else Verdict(None, unavailable=True)
        self._recovered()
        refused_by = {1: None, 0: "requests", -1: "tokens"}[int(code)]
        return _verdict(key, int(requests), int(rttl) / 1000, int(tokens), int(tttl) / 1000,
                        refused_by)

    async def charge_tokens(self, key: APIKey, tokens: int) -> None:
        import redis.exceptions

        if key.tokens_per_minute is None or tokens <= 0:
            return
        try:
            await self._charge(keys=self._keys(key)[1:], args=[tokens, int(WINDOW_S * 1000)])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                OSError) as exc:
            self._outage(exc)
            return
        self._recovered()

    async def close(self) -> None:
        await self.client.aclose()


def backend_kind(backend: str) -> str:
    """"memory" or "redis" for a --rate-limit-backend value; ValueError for anything else,
    or for redis:// without the redis package."""
    if backend in ("", "memory"):
        return "memory"
    if backend.startswith(("redis://", "rediss://", "unix://")):
        try:
            import redis  # noqa: F401
        except ImportError:
            raise ValueError("--rate-limit-backend redis:// needs the redis package: "
                             "pip install 'jaxserve[redis]'") from None
        return "redis"
    raise ValueError(f"--rate-limit-backend must be 'memory' or redis://HOST:PORT, "
                     f"got {backend!r}")


def make_rate_limiter(backend: str, fail_mode: str = "closed") -> RateLimiter:
    """`--rate-limit-backend`: "memory" or a redis:// URL."""
    if backend_kind(backend) == "memory":
        return MemoryRateLimiter()
    return RedisRateLimiter(backend, fail_open=fail_mode == "open")
