"""Per-step sampling inputs: the pytree the jitted sampler reads, and its numpy builder.

``SamplingTensorBuilder.build`` turns the scheduled sequences into one
``SamplingTensors`` of numpy arrays padded to a sequence bucket; the engine
device_puts it. Per-sequence constants (temperature, ...) are computed once
per sequence and cached until ``release(seq_id)``; the token history used by
the penalties is appended incrementally. When no row needs penalties (or
bias), those leaves are shared read-only constants, so the engine can swap in
device-resident copies instead of sending them.

Buffer lifetime: ``jax.device_put`` of a numpy array on CPU may alias the host
memory (zero-copy), so the arrays of one ``build`` must not be rewritten while
their device copy is in use. The builder rotates ``num_buffers`` (default 2)
sets of buffers: a result stays valid until ``num_buffers`` further builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxserve.engine.sequence import Sequence
    from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling inputs of one step; S = padded number of sequences. Padding rows are greedy.

    ``needs_penalties`` / ``needs_bias`` are host-side hints, not pytree leaves: False
    means the matching leaves are the builder's shared constants (all -1 ids). They
    read True after a pytree round trip (device_put, jit), so read them before.
    """

    temperature: np.ndarray         # f32[S]; < 1e-5 = greedy
    top_k: np.ndarray               # i32[S]; 0 = off
    top_p: np.ndarray               # f32[S]; 1 = off
    min_p: np.ndarray               # f32[S]; 0 = off
    presence_penalty: np.ndarray    # f32[S]
    frequency_penalty: np.ndarray   # f32[S]
    repetition_penalty: np.ndarray  # f32[S]; 1 = off
    seeds: np.ndarray               # u32[S]; row uniforms = hash(seed, step_index, column)
    step_index: np.ndarray          # i32[S]; number of output tokens so far
    num_logprobs: np.ndarray        # i32[S]; -1 = no logprobs requested, else top-N
    penalty_token_ids: np.ndarray   # i32[S, P]; prompt + output ids, -1 padded; P = max_model_len
    num_prompt_tokens: np.ndarray   # i32[S]; positions below this are prompt tokens
    bias_token_ids: np.ndarray      # i32[S, NB]; -1 padded (logit_bias, min_tokens bans)
    bias_values: np.ndarray         # f32[S, NB]; additive, -inf bans
    needs_penalties: bool = dataclasses.field(default=True, compare=False)
    needs_bias: bool = dataclasses.field(default=True, compare=False)


_LEAVES = [f.name for f in dataclasses.fields(SamplingTensors)
           if f.name not in ("needs_penalties", "needs_bias")]
jax.tree_util.register_dataclass(SamplingTensors, data_fields=_LEAVES, meta_fields=[],
                                 drop_fields=["needs_penalties", "needs_bias"])

# Row layout of the packed per-row buffers; padding rows take these neutral values.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_FLOAT_NEUTRAL = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
_INT_FIELDS = ("top_k", "step_index", "num_logprobs", "num_prompt_tokens")
_INT_NEUTRAL = (0, 0, -1, 0)


def seed_to_u32(seed: int) -> int:
    """Fold a Python int seed (any size or sign) into 32 bits for the in-jit PRNG key."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class _SeqRow:
    """What a sequence contributes to every step, computed once."""

    __slots__ = ("floats", "top_k", "num_logprobs", "seed", "min_tokens", "needs_penalties",
                 "bias", "bias_banned", "history", "history_len")

    def __init__(self, seq: "Sequence", eos_token_ids: Seq[int], num_bias_slots: int,
                 max_model_len: int) -> None:
        p: SamplingParams = seq.sampling_params
        self.floats = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                       p.frequency_penalty, p.repetition_penalty)
        self.top_k = p.top_k
        self.num_logprobs = -1 if p.logprobs is None else p.logprobs
        self.seed = seed_to_u32(seq.seed)
        self.min_tokens = p.min_tokens
        self.needs_penalties = (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                                or p.repetition_penalty != 1.0)
        bias = dict(p.logit_bias or {})
        bans = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        banned = {**bias, **{t: -np.inf for t in bans}} if p.min_tokens > 0 else bias
        if len(banned) > num_bias_slots:
            raise ValueError(f"request needs {len(banned)} logit-bias slots (logit_bias plus "
                             f"min_tokens bans of EOS/stop_token_ids), more than "
                             f"num_bias_slots={num_bias_slots}")
        self.bias = _bias_row(bias, num_bias_slots)
        self.bias_banned = _bias_row(banned, num_bias_slots) if banned is not bias else self.bias
        self.history: np.ndarray | None = (np.full(max_model_len, -1, np.int32)
                                           if self.needs_penalties else None)
        self.history_len = 0

    def bias_for(self, num_output_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.bias_banned if num_output_tokens < self.min_tokens else self.bias

    def update_history(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > len(self.history):
            raise ValueError(f"sequence has {n} tokens, more than max_model_len="
                             f"{len(self.history)}")
        if n < self.history_len:       # token ids are append-only; rebuild if not
            self.history[:] = -1
            self.history_len = 0
        self.history[self.history_len:n] = token_ids[self.history_len:n]
        self.history_len = n
        return self.history


def _bias_row(entries: dict[int, float], width: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not entries:
        return None
    ids = np.full(width, -1, np.int32)
    values = np.zeros(width, np.float32)
    ids[:len(entries)] = list(entries)
    values[:len(entries)] = list(entries.values())
    return ids, values


class _Buffers:
    """One set of persistent host buffers (see the module note on lifetime)."""

    def __init__(self, max_num_seqs: int, num_bias_slots: int) -> None:
        self.floats = np.empty((len(_FLOAT_FIELDS), max_num_seqs), np.float32)
        self.ints = np.empty((len(_INT_FIELDS), max_num_seqs), np.int32)
        self.seeds = np.zeros(max_num_seqs, np.uint32)
        self.bias_ids = np.full((max_num_seqs, num_bias_slots), -1, np.int32)
        self.bias_values = np.zeros((max_num_seqs, num_bias_slots), np.float32)
        self.bias_dirty = np.zeros(max_num_seqs, bool)
        self.penalty_ids: np.ndarray | None = None     # [max_num_seqs, P], made on first use
        self.penalty_dirty = np.zeros(max_num_seqs, bool)


class SamplingTensorBuilder:
    """Builds ``SamplingTensors`` (numpy) for a list of sequences, padded to a bucket."""

    def __init__(self, max_num_seqs: int, max_model_len: int, num_bias_slots: int = 320,
                 eos_token_ids: Seq[int] = (), num_buffers: int = 2) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_bias_slots = num_bias_slots
        self.eos_token_ids = list(eos_token_ids)
        self._rows: dict[int, _SeqRow] = {}
        self._buffers = [_Buffers(max_num_seqs, num_bias_slots) for _ in range(num_buffers)]
        self._next = 0
        self._constants: dict[int, dict[str, np.ndarray]] = {}

    def check(self, sampling_params: "SamplingParams") -> None:
        """Raise ValueError now if a request could not be built later (bias slots)."""
        p = sampling_params
        entries = set(p.logit_bias or ())
        if p.min_tokens > 0:
            entries |= set(p.stop_token_ids) | set([] if p.ignore_eos else self.eos_token_ids)
        if len(entries) > self.num_bias_slots:
            raise ValueError(f"request needs {len(entries)} logit-bias slots (logit_bias "
                             f"plus min_tokens bans), more than num_bias_slots="
                             f"{self.num_bias_slots}")

    def release(self, seq_id: int) -> None:
        """Forget a finished (or aborted) sequence's cached row."""
        self._rows.pop(seq_id, None)

    def constants(self, padded_size: int) -> dict[str, np.ndarray]:
        """Read-only leaves used when no row needs penalties / bias (one set per bucket)."""
        consts = self._constants.get(padded_size)
        if consts is None:
            consts = {
                "penalty_token_ids": np.full((padded_size, self.max_model_len), -1, np.int32),
                "num_prompt_tokens": np.zeros(padded_size, np.int32),
                "bias_token_ids": np.full((padded_size, self.num_bias_slots), -1, np.int32),
                "bias_values": np.zeros((padded_size, self.num_bias_slots), np.float32),
            }
            for array in consts.values():
                array.flags.writeable = False
            self._constants[padded_size] = consts
        return consts

    def build(self, seqs: Seq["Sequence"], padded_size: int) -> SamplingTensors:
        """Sampling inputs for ``seqs`` (row i = seqs[i]), padded to ``padded_size`` rows."""
        n = len(seqs)
        if not n <= padded_size <= self.max_num_seqs:
            raise ValueError(f"need len(seqs)={n} <= padded_size={padded_size} <= "
                             f"max_num_seqs={self.max_num_seqs}")
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        rows = [self._row(seq) for seq in seqs]
        num_outputs = [seq.num_output_tokens for seq in seqs]

        buf.floats[:, n:padded_size] = np.array(_FLOAT_NEUTRAL, np.float32)[:, None]
        buf.ints[:, n:padded_size] = np.array(_INT_NEUTRAL, np.int32)[:, None]
        buf.seeds[n:padded_size] = 0
        if n:
            buf.floats[:, :n] = np.array([r.floats for r in rows], np.float32).T
            buf.ints[:, :n] = np.array(
                [(r.top_k, k, r.num_logprobs, s.num_prompt_tokens)
                 for r, k, s in zip(rows, num_outputs, seqs)], np.int32).T
            buf.seeds[:n] = [r.seed for r in rows]

        consts = self.constants(padded_size)
        needs_penalties = any(r.needs_penalties for r in rows)
        if needs_penalties:
            penalty_ids, num_prompt = self._fill_penalties(buf, rows, seqs, padded_size)
        else:
            penalty_ids, num_prompt = consts["penalty_token_ids"], consts["num_prompt_tokens"]
        biases = [r.bias_for(k) for r, k in zip(rows, num_outputs)]
        needs_bias = any(b is not None for b in biases)
        if needs_bias:
            bias_ids, bias_values = self._fill_bias(buf, biases, padded_size)
        else:
            bias_ids, bias_values = consts["bias_token_ids"], consts["bias_values"]

        floats = dict(zip(_FLOAT_FIELDS, buf.floats[:, :padded_size]))
        ints = dict(zip(_INT_FIELDS, buf.ints[:, :padded_size]))
        return SamplingTensors(
            temperature=floats["temperature"], top_k=ints["top_k"], top_p=floats["top_p"],
            min_p=floats["min_p"], presence_penalty=floats["presence_penalty"],
            frequency_penalty=floats["frequency_penalty"],
            repetition_penalty=floats["repetition_penalty"], seeds=buf.seeds[:padded_size],
            step_index=ints["step_index"], num_logprobs=ints["num_logprobs"],
            penalty_token_ids=penalty_ids, num_prompt_tokens=num_prompt,
            bias_token_ids=bias_ids, bias_values=bias_values,
            needs_penalties=needs_penalties, needs_bias=needs_bias)

    def _row(self, seq: "Sequence") -> _SeqRow:
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = _SeqRow(seq, self.eos_token_ids, self.num_bias_slots, self.max_model_len)
            self._rows[seq.seq_id] = row
        return row

    def _fill_penalties(self, buf: _Buffers, rows: list[_SeqRow], seqs: Seq["Sequence"],
                        padded_size: int) -> tuple[np.ndarray, np.ndarray]:
        if buf.penalty_ids is None:
            buf.penalty_ids = np.full((self.max_num_seqs, self.max_model_len), -1, np.int32)
        written = np.zeros(self.max_num_seqs, bool)
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if row.needs_penalties:
                buf.penalty_ids[i] = row.update_history(seq.token_ids)
                written[i] = True
        stale = buf.penalty_dirty & ~written
        buf.penalty_ids[stale] = -1
        buf.penalty_dirty = written
        return buf.penalty_ids[:padded_size], buf.ints[_INT_FIELDS.index("num_prompt_tokens"),
                                                       :padded_size]

    def _fill_bias(self, buf: _Buffers, biases: list, padded_size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        written = np.zeros(self.max_num_seqs, bool)
        for i, bias in enumerate(biases):
            if bias is not None:
                buf.bias_ids[i], buf.bias_values[i] = bias
                written[i] = True
        stale = buf.bias_dirty & ~written
        buf.bias_ids[stale] = -1
        buf.bias_values[stale] = 0.0
        buf.bias_dirty = written
        return buf.bias_ids[:padded_size], buf.bias_values[:padded_size]
