"""How much of the prefix a tile of the block-sparse prefill kernel must read, from a model's own
teacher-forced selections (the torch path, on any device): no GPU and no kernel needed.

The kernel (kernels/sparse_prefill.py) gives a program a tile of consecutive query positions of one KV
head and walks the tile's causal prefix in blocks of keys, skipping a block that no query of the tile
keeps a page of. Its work is the blocks it keeps; the per-position decode path's is each position's own
kept tokens. For each budget and (positions per tile, pages per key block), this prints the share of the
tiles' causal key blocks the kernel processes and, beside it, the share of causal tokens a position keeps
(what the per-position path reads). A text scored with the model's own weights shows what a trained
model's selections allow; random tokens and weights (--random) keep almost every block.

    .venv/bin/python bench/prefill_tiles.py --text docs/training.md          # SmolLM2-135M, 6K tokens
    .venv/bin/python bench/prefill_tiles.py --task kv_lookup
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.stages.attention import sparse
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences
from sparrow.stages.tasks import make_prompts


class TileCounter:
    """Wraps `sparse.kept_page_mask` and counts, per (budget, tile positions, block pages), the key blocks
    a tile keeps, its causal blocks, the tokens its positions keep and their causal tokens."""

    def __init__(self, configs: list[tuple[int, int]], page: int = 16):
        self.configs, self.page = configs, page
        self.counts: dict[tuple[int, int, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
        self.mask = sparse.kept_page_mask

    def __call__(self, q, centroids, pos, budgets, page):
        pages = self.mask(q, centroids, pos, budgets, page)  # [B, Hkv, C, n_pages]
        budget = int(budgets.max())
        for tile, block in self.configs:
            for i in range(pages.shape[0]):
                for lo in range(0, pages.shape[2] - tile + 1, tile):
                    self.count(self.counts[budget, tile, block], pages[i, :, lo:lo + tile],
                               pos[i, lo:lo + tile], block)
        return pages

    def count(self, into: list[int], rows, pos, block: int) -> None:
        """rows [Hkv, tile, n_pages] kept pages of a tile's positions pos [tile]."""
        hkv = rows.shape[0]
        blocks = int(pos.max()) // (self.page * block) + 1
        kept = rows.any(1)[:, : blocks * block]
        kept = F.pad(kept, (0, blocks * block - kept.shape[1])).view(hkv, blocks, block).any(-1)
        into[0] += int(kept.sum())
        into[1] += blocks * hkv
        into[2] += int(rows.sum()) * self.page
        into[3] += int((pos + 1).sum()) * hkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", help="a text file whose tokens are the sequence")
    ap.add_argument("--task", help="a task whose first prompt is the sequence (e.g. kv_lookup)")
    ap.add_argument("--random", action="store_true", help="random tokens and random weights")
    ap.add_argument("--length", type=int, default=6144)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--rows", default="128,64,32", help="query rows per tile (positions: rows // G)")
    ap.add_argument("--block-pages", default="4,2", help="pages per key block")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if sum(map(bool, (args.text, args.task, args.random))) != 1:
        ap.error("give one of --text, --task, --random")
    if args.text and not Path(args.text).is_file():
        ap.error(f"--text {args.text}: no such file")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, random_weights=args.random)
    cfg = loaded.config
    group = cfg.num_heads // cfg.num_kv_heads
    if args.text:
        ids = loaded.tokenizer.encode(open(args.text).read())[: args.length]
    elif args.task:
        rows = make_prompts(args.task, 1, 0, loaded.tokenizer, context_tokens=args.length)
        ids = list(rows[0]["prompt_token_ids"])[: args.length]
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (args.length,), generator=g).tolist()
    configs = [(int(r) // group, int(b)) for r in args.rows.split(",") for b in args.block_pages.split(",")]
    counter = TileCounter(configs)
    sparse.kept_page_mask = counter
    budgets = [int(b) for b in args.budgets.split(",")]
    score_sequences(loaded.model.eval(), [ids[: args.prompt_tokens]], [ids[args.prompt_tokens:]], budgets)
    source = args.text or args.task or "random tokens, random weights"
    print(f"{args.model} ({group} query heads a KV head), {len(ids)} tokens of {source}, "
          f"{args.prompt_tokens} of them the prompt")
    print(f"{'budget':>6} {'positions':>9} {'keys':>5} {'blocks kept':>12} {'tokens kept':>12}")
    for (budget, tile, block), (kept, blocks, tokens, causal) in sorted(counter.counts.items()):
        print(f"{budget:>6} {tile:>9} {block * 16:>5} {kept / blocks:>12.3f} {tokens / causal:>12.3f}")


if __name__ == "__main__":
    main()
