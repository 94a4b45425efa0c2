"""The floor for bench_tree.py: a naive per-token pure-Python trie.

One dict node per token, a block id stored at each block's last token, LRU
eviction by scanning every leaf on each call. Obviously correct, obviously slow:
the ratio against it says how much the radix tree's layout buys.
"""

from __future__ import annotations


class _TokenNode:
    __slots__ = ("children", "parent", "token", "block", "last_access")

    def __init__(self, parent: _TokenNode | None, token: int) -> None:
        self.children: dict[int, _TokenNode] = {}
        self.parent = parent
        self.token = token
        self.block: int | None = None
        self.last_access = 0


class NaiveTrie:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = _TokenNode(None, -1)
        self.clock = 0

    def match(self, tokens: list[int]) -> list[int]:
        self.clock += 1
        bs = self.block_size
        node, out = self.root, []
        usable = len(tokens) // bs * bs
        for i in range(usable):
            node = node.children.get(tokens[i])
            if node is None:
                break
            node.last_access = self.clock
            if (i + 1) % bs == 0:
                out.append(node.block)
        return out

    def insert(self, tokens: list[int], blocks: list[int]) -> int:
        self.clock += 1
        bs = self.block_size
        node, cached = self.root, 0
        for i in range(len(tokens) // bs * bs):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _TokenNode(node, tokens[i])
                if (i + 1) % bs == 0:
                    child.block = blocks[i // bs]
            elif (i + 1) % bs == 0 and cached == i + 1 - bs:
                cached = i + 1
            child.last_access = self.clock
            node = child
        return cached

    def evict(self, num_blocks: int) -> int:
        """Free at least num_blocks blocks, least recently used leaf block first."""
        freed = 0
        while freed < num_blocks:
            leaves, stack = [], [self.root]
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node is not self.root:
                    leaves.append(node)
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_access)
            for leaf in leaves:
                # drop the leaf's whole last block: bs token nodes up the chain
                node = leaf
                for _ in range(self.block_size):
                    parent = node.parent
                    del parent.children[node.token]
                    if parent.children or parent is self.root:
                        break
                    node = parent
                freed += 1
                if freed >= num_blocks:
                    break
        return freed
