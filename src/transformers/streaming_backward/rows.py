"""Row-wise gradients of a streamed layer's backward (dK, dV, the input's) kept per row block, each block freed
once it is final, so final rows need not stay alive next to rows still being summed (StreamBP, arXiv 2506.03077
§3.2.2: the backward runs the query chunks from the last to the first)."""

import bisect

import torch


# Rows per block: consecutive query chunks are grouped into blocks of at least this many rows. Smaller blocks
# free memory sooner, larger ones keep the adds into them few. Measured (fp32, d=256, 256-token chunks, 2
# threads): 256 rows against 1024 hold 0.75 MiB less at S=32K and take the same time at S=8K (6.65 s a step).
BLOCK_ROWS = 256
# At most about this many blocks: a chunk's dK/dV part is added block by block, so many small blocks mean many
# small adds (quadratic in the number of blocks); 1/16 of dK/dV held a little longer is what that costs.
MAX_BLOCKS = 16


SOME_ROWS_ONLY = ("streaming backward: the layer input got a gradient for some rows only; refusing to return an "
                  "incomplete gradient. Please report this with your setup.")


def covers(ranges, start, end) -> bool:
    """Whether the row ranges [(start, end)] together cover every row of [start, end)."""
    reached = start
    for first, last in sorted(ranges):
        if first > reached:
            return False
        reached = max(reached, last)
    return reached >= end


def row_blocks(chunks):
    """Consecutive chunks [(start, end)] grouped into blocks of at least max(BLOCK_ROWS, sequence / MAX_BLOCKS)
    rows: [[first, end_chunk]]."""
    rows = max(BLOCK_ROWS, -(-chunks[-1][1] // MAX_BLOCKS))
    blocks = []
    for index, (start, _) in enumerate(chunks):
        if not blocks or chunks[blocks[-1][0]][0] + rows <= start:
            blocks.append([index, index + 1])
        blocks[-1][1] = index + 1
    return blocks


class RowBlocks:
    """A gradient over the sequence's rows (dK, dV: dim 2; the layer input's: dim 1), one zero-initialised tensor
    per row block (`row_blocks`), made when first written and handed over once final (`pop`)."""

    def __init__(self, chunks, blocks, like: torch.Tensor, dim: int, dtype: torch.dtype):
        self.bounds = [(chunks[first][0], chunks[end - 1][1]) for first, end in blocks]
        self.starts = [start for start, _ in self.bounds]
        self.shape, self.device, self.dim, self.dtype = list(like.shape), like.device, dim, dtype
        self.parts = {}
        self.added = set()  # the row ranges [start, end) added, for `whole`'s check that every row got a part

    @classmethod
    def holding(cls, chunks, blocks, total: torch.Tensor, dim: int) -> "RowBlocks":
        """One block (`blocks` == [[0, len(chunks)]]) already summed: `total`."""
        if len(blocks) != 1:
            raise ValueError("RowBlocks.holding takes a single block")
        held = cls(chunks, blocks, total, dim, total.dtype)
        held.parts[0] = total
        return held

    def block_of(self, row: int) -> int:
        return bisect.bisect_right(self.starts, row) - 1

    def add(self, part: torch.Tensor, start: int, end: int) -> None:
        """Add `part` (rows [start, end) along `dim`) into the blocks it spans."""
        self.added.add((start, end))
        block, row = self.block_of(start), start
        while row < end:
            block_start, block_end = self.bounds[block]
            stop = min(end, block_end)
            total = self.parts.get(block)
            if total is None:
                self.shape[self.dim] = block_end - block_start
                total = self.parts[block] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            total.narrow(self.dim, row - block_start, stop - row).add_(part.narrow(self.dim, row - start, stop - row))
            row, block = stop, block + 1

    def rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) (inside one block) in `dtype`; zeros if nothing was added to that block."""
        block = self.block_of(start)
        block_start = self.bounds[block][0]
        total = self.parts.get(block)
        if total is None:
            self.shape[self.dim] = end - start
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        return total.narrow(self.dim, start - block_start, end - start).to(dtype)

    def pop(self, block: int) -> torch.Tensor | None:
        """Block `block`'s sum (None if nothing was added to it), no longer held here."""
        return self.parts.pop(block, None)

    def whole(self) -> torch.Tensor:
        """Every block's sum joined along `dim`, no longer held here; refused where a row got nothing (the layer
        input's gradient: every chunk's rows get one)."""
        if not covers(self.added, self.bounds[0][0], self.bounds[-1][1]):
            raise RuntimeError(SOME_ROWS_ONLY)
        parts = [self.parts.pop(block) for block in range(len(self.bounds))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def pop_or_zeros(self, block: int) -> torch.Tensor:
        """Block `block`'s sum (zeros if nothing was added to it), no longer held here."""
        total = self.parts.pop(block, None)
        if total is None:
            start, end = self.bounds[block]
            self.shape[self.dim] = end - start
            total = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return total


def slice_rows(value, start, end, seq_len):
    """`value` (a tensor or tuple of tensors) cut to rows [start, end) along dim 1 where dim 1 is the sequence: a
    chunk's part of a call's argument (a [B, S] mask, position ids; streamed and recurrent layers alike)."""
    if isinstance(value, (tuple, list)):
        return type(value)(slice_rows(v, start, end, seq_len) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
        return value[:, start:end]
    return value


def row_inputs(arguments, batch, seq_len):
    """A layer call's other tensors that are rows of the sequence and require grad (Gemma-4's per-layer input,
    Zamba2's embeddings): inputs of the streamed Functions, each chunk's recompute reading its rows as leaves, their
    gradients summed row by row like the layer input's. Any other tensor that requires grad is refused by the graph
    check (mst_core/wrappers.py)."""
    return {
        name: value for name, value in arguments.items()
        if isinstance(value, torch.Tensor) and value.requires_grad and value.dim() >= 2
        and value.shape[:2] == (batch, seq_len)
    }
