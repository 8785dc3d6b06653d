"""The runner's persistent batch: one numpy row per live sequence, updated from diffs.

A row holds what the step needs of a sequence — its known token ids, block table,
computed count and sampling parameters — and lives as long as the sequence holds
KV blocks: it is filled once from a `NewSeqData`, grows by the new block ids and
sampled tokens, and is dropped when the sequence finishes or is preempted. Each
step then assembles its packed inputs with a handful of vectorised numpy gathers
over the scheduled rows: host work per step is O(changes) in Python and O(rows)
in numpy, never a loop over block tables.

Pure numpy, no JAX: the scheduler state-machine tests drive it without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np

from jaxserve.runner.penalty_state import history_chunk_size, history_entries
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import NewSeqData, SchedulerOutput
from jaxserve.step_inputs import FLOAT_FIELDS, FLOAT_NEUTRAL, StepLayout


def seed_to_u32(seed: int) -> int:
    """Fold a Python int seed (any size or sign) into 32 bits for the in-jit PRNG."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


@dataclass
class PenaltyAdmissions:
    """The penalty rows admitted since the last step, for the device's `load_history`: the
    rows to zero, then their known tokens (prompt and earlier outputs) in chunks."""
    resets: np.ndarray      # i32[R]: rows first, -1 padded
    chunks: np.ndarray      # i32[N, 3, C]: (row, token, is_prompt) entries, row -1 = unused


@dataclass
class StepInputs:
    """Host inputs of one step: the packed int32 buffer, plus the big per-row sampling
    tables only when some row needs them (None: the runner's device-resident constants)."""
    num_tokens: int                       # bucket T
    num_seqs: int                         # bucket S
    packed: np.ndarray                    # i32[StepLayout(T, S, W).size]
    penalty_admissions: PenaltyAdmissions | None   # rows whose penalty history to load
    bias_token_ids: np.ndarray | None     # i32[S, NB]: -1 padded
    bias_values: np.ndarray | None        # f32[S, NB]: additive, -inf bans
    grammar_bitmask: np.ndarray | None = None   # i32[S, ceil(V/32)]: structured outputs
    # Host only (never sent to followers): (batch row, first prompt entry, first slot, count)
    # of each row whose prompt logprobs this step computes.
    prompt_logprobs_rows: tuple[tuple[int, int, int, int], ...] = ()


class _Bias:
    """A row's logit bias, with and without the min_tokens bans of EOS / stop tokens."""

    __slots__ = ("plain", "banned", "min_tokens")

    def __init__(self, params: SamplingParams, eos_token_ids: Seq[int], width: int) -> None:
        bias = dict(params.logit_bias or {})
        self.min_tokens = params.min_tokens
        bans = list(params.stop_token_ids or ()) + ([] if params.ignore_eos
                                                    else list(eos_token_ids))
        banned = {**bias, **{t: -np.inf for t in bans}} if params.min_tokens > 0 else bias
        if len(banned) > width:
            raise ValueError(f"request needs {len(banned)} logit-bias slots (logit_bias plus "
                             f"min_tokens bans of EOS/stop_token_ids), more than "
                             f"num_bias_slots={width}")
        self.plain = _bias_row(bias, width)
        self.banned = _bias_row(banned, width)

    def at(self, num_output_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.banned if num_output_tokens < self.min_tokens else self.plain


def _bias_row(entries: dict[int, float], width: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not entries:
        return None
    ids = np.full(width, -1, np.int32)
    values = np.zeros(width, np.float32)
    ids[:len(entries)] = list(entries)
    values[:len(entries)] = list(entries.values())
    return ids, values


class InputBatch:
    """Rows ``0 .. max_num_seqs - 1``; row ``max_num_seqs`` is a permanent blank (padding)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int,
                 max_blocks_per_seq: int, *, num_bias_slots: int = 320,
                 eos_token_ids: Seq[int] = (), prompt_logprobs_cap: int = 0,
                 vocab_size: int = 0, lora: bool = False) -> None:
        R, L, W = max_num_seqs, max_model_len, max_blocks_per_seq
        self.max_num_seqs, self.max_model_len, self.block_size, self.width = R, L, block_size, W
        self.padding_row = R
        self.num_bias_slots = num_bias_slots
        self.prompt_logprobs_cap = prompt_logprobs_cap
        self.eos_token_ids = list(eos_token_ids)
        self.bitmask_words = (vocab_size + 31) // 32     # grammar bitmask: 32 tokens a word
        self.token_ids = np.full((R + 1, L), -1, np.int32)   # known tokens; -1 beyond
        self.num_known = np.zeros(R + 1, np.int32)           # tokens the host knows
        self.num_prompt = np.zeros(R + 1, np.int32)
        self.num_computed = np.zeros(R + 1, np.int32)
        self.block_table = np.zeros((R + 1, W), np.int32)
        self.num_blocks = np.zeros(R + 1, np.int32)
        self.floats = np.zeros((len(FLOAT_FIELDS), R + 1), np.float32)
        self.floats[:, R] = FLOAT_NEUTRAL
        self.top_k = np.zeros(R + 1, np.int32)
        self.num_logprobs = np.full(R + 1, -1, np.int32)
        self.wants_prompt_logprobs = np.zeros(R + 1, bool)
        self.seeds = np.zeros(R + 1, np.uint32)
        self.needs_penalties = np.zeros(R + 1, bool)
        self.seq_of_row = np.full(R + 1, -1, np.int64)
        self.lora = lora                                     # steps carry lora_slots[T]
        self.lora_slot = np.zeros(R + 1, np.int32)           # each row's adapter slot
        self.row_of: dict[int, int] = {}
        self._bias: dict[int, _Bias] = {}                    # rows with a bias or min_tokens
        self._free_rows = list(range(R - 1, -1, -1))         # pop() hands out row 0 first
        # Penalty rows added since the last prepare: their history is not on the device yet.
        self._unloaded_penalty_rows: list[int] = []
        self.history_chunk = history_chunk_size(L)
        self._buffers: dict[tuple[int, int], tuple[StepLayout, np.ndarray]] = {}
        self._next_buffer = 0
        self._constants: dict[int, dict[str, np.ndarray]] = {}

    # -- validation ------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """Raise ValueError now if a request could not be given a row later (bias slots,
        prompt logprobs turned off)."""
        if params.prompt_logprobs is not None and self.prompt_logprobs_cap == 0:
            raise ValueError("prompt_logprobs is turned off on this engine "
                             "(max_prompt_logprobs_per_step=0)")
        _Bias(params, self.eos_token_ids, self.num_bias_slots)

    # -- diffs -----------------------------------------------------------------------------
    def apply(self, out: SchedulerOutput) -> np.ndarray:
        """Bring the rows up to date with ``out``; returns the step's rows in batch order."""
        for seq_id, length in out.block_table_lengths.items():
            row = self.row_of.get(seq_id)
            if row is not None:
                self.num_blocks[row] = length
        for seq_id in out.finished_seq_ids:
            self.remove(seq_id)
        for seq_id in out.preempted_seq_ids:
            self.remove(seq_id)
        for new in out.new_seqs:
            self.add(new)
        for seq_id, block_ids in out.new_block_ids.items():
            row = self.row_of[seq_id]
            start = self.num_blocks[row]
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
        row_of = self.row_of
        rows = np.fromiter((row_of[seq_id] for seq_id in out.seq_ids), np.int64, out.num_rows)
        self.num_computed[rows] = out.num_computed_tokens
        return rows

    def add(self, new: NewSeqData) -> None:
        if new.seq_id in self.row_of:
            raise ValueError(f"sequence {new.seq_id} already has a row")
        row = self._free_rows.pop()
        self.row_of[new.seq_id] = row
        self.seq_of_row[row] = new.seq_id
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_known[row] = n
        self.num_prompt[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        p = new.sampling_params
        self.floats[:, row] = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                               p.frequency_penalty, p.repetition_penalty)
        self.top_k[row] = p.top_k
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.wants_prompt_logprobs[row] = p.prompt_logprobs is not None
        self.seeds[row] = seed_to_u32(new.seed)
        self.lora_slot[row] = new.adapter_slot
        self.needs_penalties[row] = (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                                     or p.repetition_penalty != 1.0)
        if self.needs_penalties[row]:
            self._unloaded_penalty_rows.append(row)
        bias = _Bias(p, self.eos_token_ids, self.num_bias_slots)
        if bias.plain is not None or bias.banned is not None:
            self._bias[row] = bias

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.token_ids[row, :self.num_known[row]] = -1
        self.num_known[row] = 0
        self.seq_of_row[row] = -1
        self.lora_slot[row] = 0
        self.wants_prompt_logprobs[row] = False
        if self.needs_penalties[row] and row in self._unloaded_penalty_rows:
            self._unloaded_penalty_rows.remove(row)
        self.needs_penalties[row] = False
        self._bias.pop(row, None)
        self._free_rows.append(row)

    def record_sampled(self, seq_ids: Seq[int], rows: np.ndarray, positions: np.ndarray,
                       is_sampling: Seq[bool], tokens: Seq[int]) -> None:
        """Write a finished step's sampled tokens into the rows still owned by their seqs.

        positions: where each row's sampled token goes (its kv_len after that step).
        """
        mask = np.asarray(is_sampling, bool) & (self.seq_of_row[rows] == np.asarray(seq_ids))
        if not mask.any():
            return
        rows, positions = rows[mask], positions[mask]
        keep = positions < self.max_model_len
        rows, positions = rows[keep], positions[keep]
        self.token_ids[rows, positions] = np.asarray(tokens, np.int32)[mask][keep]
        self.num_known[rows] = np.maximum(self.num_known[rows], positions + 1)

    def record_emitted(self, seq_ids: Seq[int], rows: np.ndarray, first_positions: np.ndarray,
                       is_sampling: Seq[bool], tokens: np.ndarray, counts: np.ndarray) -> None:
        """Speculative decoding's `record_sampled`: row i emitted tokens[i, :counts[i]],
        the first at first_positions[i] (its newest token's position + 1)."""
        mask = np.asarray(is_sampling, bool) & (self.seq_of_row[rows] == np.asarray(seq_ids))
        if not mask.any():
            return
        rows, first, tokens, counts = rows[mask], first_positions[mask], tokens[mask], \
            counts[mask]
        column = np.arange(tokens.shape[1])
        positions = first[:, None] + column[None, :]
        keep = (column[None, :] < counts[:, None]) & (positions < self.max_model_len)
        grid_rows = np.broadcast_to(rows[:, None], positions.shape)
        self.token_ids[grid_rows[keep], positions[keep]] = tokens[keep]
        self.num_known[rows] = np.maximum(self.num_known[rows],
                                          np.minimum(first + counts, self.max_model_len))

    # -- one step --------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, rows: np.ndarray, num_tokens: int,
                num_seqs: int) -> StepInputs:
        """Pack the step's inputs for bucket (T, S) = (num_tokens, num_seqs)."""
        T, S, bs = num_tokens, num_seqs, self.block_size
        n = rows.shape[0]
        layout, buf = self._buffer(T, S)
        v = layout.views(buf)
        counts = np.asarray(out.num_scheduled_tokens, np.int32)
        ends = np.cumsum(counts, dtype=np.int32)
        live = int(ends[-1]) if n else 0
        computed = self.num_computed[rows]
        # Flat token axis: token t belongs to batch row seq_index[t].
        if live == n:                                   # pure decode: one token per row
            seq_index = np.arange(n)
            positions = computed
        else:
            seq_index = np.repeat(np.arange(n), counts)
            positions = computed[seq_index] + (np.arange(live, dtype=np.int32)
                                               - (ends - counts)[seq_index])
        token_rows = rows[seq_index]
        tokens = self.token_ids[token_rows, positions]
        # A position the host does not know yet holds last step's sample: the device has it.
        unknown = positions >= self.num_known[token_rows]
        tokens[unknown] = -1 - token_rows[unknown]
        v["num_drafts"][:] = 0
        v["penalty_counted"][:n] = np.asarray(out.is_sampling, bool) & self.needs_penalties[rows]
        v["penalty_counted"][n:] = 0
        if out.draft_token_ids:     # a row's drafts follow its newest token on the token axis
            for i, seq_id in enumerate(out.seq_ids):
                drafts = out.draft_token_ids.get(seq_id)
                if drafts:
                    end = int(ends[i])
                    tokens[end - len(drafts):end] = drafts
                    v["num_drafts"][i] = len(drafts)
        v["token_ids"][:live] = tokens
        v["token_ids"][live:] = 0
        v["positions"][:live] = positions
        v["positions"][live:] = 0
        blocks = self.block_table[token_rows, positions // bs]
        v["slot_mapping"][:live] = blocks * bs + positions % bs
        v["slot_mapping"][live:] = -1
        kv_lens = computed + counts
        v["query_start_loc"][0] = 0
        v["query_start_loc"][1:n + 1] = ends
        v["query_start_loc"][n + 1:] = live
        v["kv_lens"][:n] = kv_lens
        v["kv_lens"][n:] = 0
        v["logits_indices"][:n] = ends - 1
        v["logits_indices"][n:] = 0
        v["batch_rows"][:n] = rows
        v["batch_rows"][n:] = self.padding_row
        v["num_seqs"][0] = n
        padded = np.full(S, self.padding_row, np.int64)
        padded[:n] = rows
        v["top_k"][:] = self.top_k[padded]
        v["seeds"][:] = self.seeds[padded]
        v["num_logprobs"][:] = self.num_logprobs[padded]
        v["num_prompt_tokens"][:] = self.num_prompt[padded]
        floats = self.floats[:, padded]
        for i, name in enumerate(FLOAT_FIELDS):
            v[name][:] = floats[i]
        v["block_tables"][:n] = self.block_table[rows]
        if self.lora:
            v["lora_slots"][:live] = self.lora_slot[token_rows]
            v["lora_slots"][live:] = 0
        v["block_tables"][n:] = 0
        prompt_logprobs_rows = self._prompt_logprobs_slots(v, rows, computed, counts, ends,
                                                           layout.num_prompt_logprobs)

        bias_ids = bias_values = None
        if self._bias:
            bias_ids, bias_values = self._bias_tables(rows, kv_lens, S)
        bitmask = None
        if out.grammar_bitmask is not None:     # padding rows: all tokens allowed
            bitmask = np.full((S, self.bitmask_words), -1, np.int32)
            bitmask[:n] = out.grammar_bitmask
        return StepInputs(T, S, buf, self._penalty_admissions(), bias_ids, bias_values,
                          bitmask, prompt_logprobs_rows)

    def _penalty_admissions(self) -> PenaltyAdmissions | None:
        """Once per admitted penalty row: its reset and the tokens the host knows of it
        (later tokens are counted on the device as they are sampled)."""
        if not self._unloaded_penalty_rows:
            return None
        rows = np.asarray(self._unloaded_penalty_rows, np.int64)
        self._unloaded_penalty_rows = []
        resets = np.full(self.max_num_seqs, -1, np.int32)
        resets[:len(rows)] = rows
        tokens = [self.token_ids[row, :self.num_known[row]] for row in rows.tolist()]
        chunks = history_entries(rows, tokens, self.num_prompt[rows].tolist(),
                                 self.history_chunk)
        return PenaltyAdmissions(resets, np.stack(chunks))

    def _prompt_logprobs_slots(self, v: dict[str, np.ndarray], rows: np.ndarray,
                               computed: np.ndarray, counts: np.ndarray, ends: np.ndarray,
                               num_slots: int) -> tuple[tuple[int, int, int, int], ...]:
        """Fill the prompt-logprobs gather: each position p of this step's chunk that is before
        the prompt's last token predicts prompt token p + 1 (known on the host)."""
        targets = v["prompt_logprobs_targets"]
        targets[:] = -1
        if not self.wants_prompt_logprobs[rows].any():
            return ()
        indices = v["prompt_logprobs_indices"]
        slot, out = 0, []
        for i in np.flatnonzero(self.wants_prompt_logprobs[rows]).tolist():
            row, start = int(rows[i]), int(computed[i])
            stop = min(start + int(counts[i]), int(self.num_prompt[row]) - 1)
            count = stop - start
            if count <= 0:
                continue
            if slot + count > num_slots:
                raise ValueError(f"step needs {slot + count} prompt-logprobs positions, more "
                                 f"than its {num_slots} (the scheduler caps them)")
            first_token = int(ends[i] - counts[i])
            indices[slot:slot + count] = np.arange(first_token, first_token + count)
            targets[slot:slot + count] = self.token_ids[row, start + 1:stop + 1]
            out.append((i, start + 1, slot, count))
            slot += count
        return tuple(out)

    def _bias_tables(self, rows: np.ndarray, kv_lens: np.ndarray, num_seqs: int):
        entries = []
        for i, row in enumerate(rows.tolist()):
            bias = self._bias.get(row)
            if bias is not None:
                table = bias.at(int(kv_lens[i]) - int(self.num_prompt[row]))
                if table is not None:
                    entries.append((i, table))
        if not entries:
            return None, None
        ids = np.full((num_seqs, self.num_bias_slots), -1, np.int32)
        values = np.zeros((num_seqs, self.num_bias_slots), np.float32)
        for i, (row_ids, row_values) in entries:
            ids[i], values[i] = row_ids, row_values
        return ids, values

    def _buffer(self, T: int, S: int) -> tuple[StepLayout, np.ndarray]:
        """The packed buffer of bucket (T, S), rewritten by every step of that bucket (the
        runner hands the device a copy: ModelRunner.run_step)."""
        entry = self._buffers.get((T, S))
        if entry is None:
            layout = StepLayout(T, S, self.width, self.prompt_logprobs_cap, self.lora)
            entry = self._buffers[(T, S)] = (layout, layout.empty(self.padding_row))
        return entry

    def empty_inputs(self, num_tokens: int, num_seqs: int, *, penalty_chunks: int = 0,
                     bias: bool = False, grammar: bool = False) -> StepInputs:
        """An all-padding step of bucket (T, S), with the optional tables when asked (the
        shapes a multi-host follower receives into)."""
        consts = self.constants(num_seqs)
        admissions = None
        if penalty_chunks:
            admissions = PenaltyAdmissions(
                np.full(self.max_num_seqs, -1, np.int32),
                np.full((penalty_chunks, 3, self.history_chunk), -1, np.int32))
        return StepInputs(
            num_tokens, num_seqs, StepLayout(num_tokens, num_seqs, self.width,
                                             self.prompt_logprobs_cap,
                                             self.lora).empty(self.padding_row),
            admissions,
            consts["bias_token_ids"].copy() if bias else None,
            consts["bias_values"].copy() if bias else None,
            consts["grammar_bitmask"].copy() if grammar else None)

    def constants(self, num_seqs: int) -> dict[str, np.ndarray]:
        """The tables a step uses when no row needs bias / a grammar (one set per S)."""
        consts = self._constants.get(num_seqs)
        if consts is None:
            consts = self._constants[num_seqs] = {
                "bias_token_ids": np.full((num_seqs, self.num_bias_slots), -1, np.int32),
                "bias_values": np.zeros((num_seqs, self.num_bias_slots), np.float32),
                "grammar_bitmask": np.full((num_seqs, self.bitmask_words), -1, np.int32)}
        return consts
