"""O(1) offset allocator for a tier's address space (TLSF, after Sebastian Aaltonen's
OffsetAllocator).

The allocator hands out ranges of abstract units (the tiers use 4 KiB pages); it
never touches the memory or file behind them. Free regions sit in 256 size bins
keyed by a small float (5-bit exponent, 3-bit mantissa: sizes below 8 are exact,
above that each power of two is split into 8 bins). A free region is filed in the
bin rounded *down* from its size, and a request searches from the bin rounded *up*
from its size, so any region found is large enough. A 32-bit top bitmap (one bit per
group of 8 bins) and an 8-bit bitmap per group find the first non-empty bin in O(1).

Allocations are exact: the found region is split and the remainder goes back as a
new free region. `free` merges with free neighbours, so no two free regions touch.

One addition to the original: when the O(1) search fails, the single bin that can
hold a region of size in [request, rounded-up request) is scanned first-fit (the
one path that is not O(1), taken only when no bin guarantees a fit). So
`alloc(n)` fails only when no free region of at least `n` units exists — e.g. a gap
left by crash recovery can always be refilled with an allocation of its exact size.

Handles are node indices and are recycled after `free`, like file descriptors: a
stale handle is caught only while its node is not live again.
"""

NO_SPACE = -1
_NONE = -1  # "no node" in the link lists

MAX_CAPACITY = 15 << 30  # size of the top bin (255); about 60 TiB in 4 KiB pages
_INITIAL_NODES = 64


def bin_round_up(size: int) -> int:
    """Smallest bin whose size is >= `size`."""
    if size < 8:
        return size
    shift = size.bit_length() - 4
    # (size >> shift) is 8 + mantissa, so this is ((shift + 1) << 3) + mantissa;
    # a ceiling of 16 carries into the exponent.
    return (shift << 3) + (-(-size >> shift))


def bin_round_down(size: int) -> int:
    """Largest bin whose size is <= `size`."""
    if size < 8:
        return size
    shift = size.bit_length() - 4
    return (shift << 3) + (size >> shift)


def bin_size(index: int) -> int:
    """The size a bin stands for; the inverse of both roundings on exact sizes."""
    if index < 8:
        return index
    return (8 | (index & 7)) << ((index >> 3) - 1)


class OffsetAllocator:
    """Allocates exact-size ranges of `[0, capacity)`; `alloc` and `free` are O(1).

    `max_allocs` optionally caps the number of live allocations (alloc returns
    NO_SPACE at the cap); without it the node table grows as needed.
    """

    def __init__(self, capacity: int, max_allocs: int | None = None) -> None:
        if not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in 1..{MAX_CAPACITY}, got {capacity}")
        if max_allocs is not None and max_allocs < 1:
            raise ValueError(f"max_allocs must be >= 1, got {max_allocs}")
        self.capacity = capacity
        self._max_allocs = max_allocs
        self._live = 0
        self._free_storage = 0
        # Nodes, as parallel lists indexed by node (= handle).
        self._off: list[int] = []
        self._size: list[int] = []
        self._bprev: list[int] = []  # free list of the node's bin
        self._bnext: list[int] = []
        self._nprev: list[int] = []  # address-order neighbours
        self._nnext: list[int] = []
        self._used: list[bool] = []
        self._stack: list[int] = []  # indices of unused nodes
        # The same lists in one tuple: hot paths unpack it instead of 7 attribute loads.
        self._nodes = (
            self._off, self._size, self._bprev, self._bnext, self._nprev, self._nnext, self._used
        )
        self._heads = [_NONE] * 256  # first free node of each bin
        self._used_bins = [0] * 32  # per group: bit i set when bin (group*8 + i) is non-empty
        self._used_top = 0  # bit g set when group g has a non-empty bin
        node = self._insert(capacity, 0)
        self._nprev[node] = _NONE
        self._nnext[node] = _NONE

    # -- public API -------------------------------------------------------

    def alloc(self, size: int) -> int:
        """A handle to `size` units, or NO_SPACE."""
        # Hot path: bin search, take and the remainder's insert are inlined.
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        free_storage = self._free_storage
        if size > free_storage or self._live == self._max_allocs:
            return NO_SPACE
        if size < 8:
            b = size
        else:
            shift = size.bit_length() - 4
            b = (shift << 3) + (-(-size >> shift))  # bin_round_up
        top = b >> 3
        used_bins = self._used_bins
        used_top = self._used_top
        leaf = -1
        if used_top >> top & 1:
            m = used_bins[top] & (-1 << (b & 7))
            leaf = (m & -m).bit_length() - 1
        if leaf < 0:
            m = used_top & (-1 << (top + 1))
            if not m:
                return self._alloc_near_fit(size)
            top = (m & -m).bit_length() - 1
            m = used_bins[top]
            leaf = (m & -m).bit_length() - 1
        b = (top << 3) | leaf
        off, sizes, bprev, bnext, nprev, nnext, used = self._nodes
        heads = self._heads
        node = heads[b]
        nxt = bnext[node]
        heads[b] = nxt
        if nxt >= 0:
            bprev[nxt] = _NONE
        else:
            m = used_bins[top] & ~(1 << leaf)
            used_bins[top] = m
            if not m:
                self._used_top = used_top & ~(1 << top)
        rem = sizes[node] - size
        sizes[node] = size
        used[node] = True
        self._live += 1
        self._free_storage = free_storage - size
        if rem:
            if rem < 8:
                b = rem
            else:
                shift = rem.bit_length() - 4
                b = (shift << 3) + (rem >> shift)  # bin_round_down
            head = heads[b]
            if head < 0:
                top = b >> 3
                used_bins[top] |= 1 << (b & 7)
                self._used_top |= 1 << top
            stack = self._stack
            new = stack.pop() if stack else self._pop_node()
            off[new] = off[node] + size
            sizes[new] = rem
            bprev[new] = _NONE
            bnext[new] = head
            if head >= 0:
                bprev[head] = new
            heads[b] = new
            after = nnext[node]
            if after >= 0:
                nprev[after] = new
            nprev[new] = node
            nnext[new] = after
            nnext[node] = new
        return node

    def free(self, handle: int) -> None:
        """Release a live allocation, merging it with free neighbours."""
        # Hot path: the merged region's insert is inlined, and the freed node itself
        # becomes that region; free neighbours go back to the node stack.
        off, sizes, bprev, bnext, nprev, nnext, used = self._nodes
        if not 0 <= handle < len(used) or not used[handle]:
            raise ValueError(f"handle {handle} is not a live allocation")
        used[handle] = False
        self._live -= 1
        heads = self._heads
        used_bins = self._used_bins
        stack = self._stack
        offset = off[handle]
        size = sizes[handle]
        self._free_storage += size
        p = nprev[handle]
        if p >= 0 and not used[p]:
            nb_size = sizes[p]
            size += nb_size
            offset = off[p]
            self._unlink(p, bin_round_down(nb_size))
            stack.append(p)
            p = nprev[p]
        n = nnext[handle]
        if n >= 0 and not used[n]:
            nb_size = sizes[n]
            size += nb_size
            self._unlink(n, bin_round_down(nb_size))
            stack.append(n)
            n = nnext[n]
        if size < 8:
            b = size
        else:
            shift = size.bit_length() - 4
            b = (shift << 3) + (size >> shift)
        head = heads[b]
        if head < 0:
            top = b >> 3
            used_bins[top] |= 1 << (b & 7)
            self._used_top |= 1 << top
        else:
            bprev[head] = handle
        off[handle] = offset
        sizes[handle] = size
        bprev[handle] = _NONE
        bnext[handle] = head
        heads[b] = handle
        nprev[handle] = p
        nnext[handle] = n
        if p >= 0:
            nnext[p] = handle
        if n >= 0:
            nprev[n] = handle

    def offset(self, handle: int) -> int:
        """First unit of a live allocation."""
        self._check(handle)
        return self._off[handle]

    def size(self, handle: int) -> int:
        """Length in units of a live allocation (exactly what was requested)."""
        self._check(handle)
        return self._size[handle]

    @property
    def used(self) -> int:
        """Units currently allocated."""
        return self.capacity - self._free_storage

    @property
    def free_units(self) -> int:
        """Units currently free (in any number of regions)."""
        return self._free_storage

    def largest_free(self) -> int:
        """Exact size of the largest free region (0 if none).

        The highest non-empty bin holds it; that bin's list is scanned, so the cost
        is the number of free regions in that one bin.
        """
        top = self._used_top.bit_length() - 1
        if top < 0:
            return 0
        b = (top << 3) | (self._used_bins[top].bit_length() - 1)
        sizes = self._size
        bnext = self._bnext
        best = 0
        node = self._heads[b]
        while node >= 0:
            if sizes[node] > best:
                best = sizes[node]
            node = bnext[node]
        return best

    def fragmentation(self) -> float:
        """1 - largest_free / free_units: 0.0 when free space is one region or none."""
        free = self._free_storage
        if not free:
            return 0.0
        return 1.0 - self.largest_free() / free

    def free_regions(self) -> list[tuple[int, int]]:
        """(offset, size) of every free region, sorted by offset. O(n log n)."""
        regions = []
        for b in range(256):
            node = self._heads[b]
            while node >= 0:
                regions.append((self._off[node], self._size[node]))
                node = self._bnext[node]
        regions.sort()
        return regions

    @classmethod
    def from_extents(
        cls, capacity: int, extents: list[tuple[int, int]], max_allocs: int | None = None
    ) -> tuple["OffsetAllocator", list[int]]:
        """An allocator with exactly `extents` (offset, size) allocated, and their handles
        in input order. Used to rebuild a disk tier's allocator after a restart."""
        order = sorted(range(len(extents)), key=lambda i: extents[i][0])
        end = 0
        for i in order:
            off, size = extents[i]
            if size < 1 or off < 0 or off + size > capacity:
                raise ValueError(f"extent {extents[i]} is empty or outside [0, {capacity})")
            if off < end:
                raise ValueError(f"extent {extents[i]} overlaps the one ending at {end}")
            end = off + size
        if max_allocs is not None and len(extents) > max_allocs:
            raise ValueError(f"{len(extents)} extents exceed max_allocs={max_allocs}")

        self = cls(capacity, max_allocs)
        # Start from an empty table and lay nodes out in address order.
        self._remove(self._heads[bin_round_down(capacity)])
        handles = [0] * len(extents)
        prev = _NONE
        pos = 0
        for i in [*order, None]:
            off, size = extents[i] if i is not None else (capacity, 0)
            nodes = []
            if off > pos:
                nodes.append(self._insert(off - pos, pos))
            if size:
                node = self._pop_node()
                self._off[node] = off
                self._size[node] = size
                self._used[node] = True
                self._live += 1
                handles[i] = node
                nodes.append(node)
            for node in nodes:
                self._nprev[node] = prev
                self._nnext[node] = _NONE
                if prev >= 0:
                    self._nnext[prev] = node
                prev = node
            pos = off + size
        return self, handles

    # -- internals --------------------------------------------------------

    def _check(self, handle: int) -> None:
        if not 0 <= handle < len(self._used) or not self._used[handle]:
            raise ValueError(f"handle {handle} is not a live allocation")

    def _take(self, node: int, size: int) -> int:
        """Mark free `node` (already off its bin list) allocated with `size` units,
        returning the remainder as a free node right after it."""
        sizes = self._size
        rem = sizes[node] - size
        sizes[node] = size
        self._used[node] = True
        self._live += 1
        self._free_storage -= size + rem  # _insert adds rem back
        if rem:
            nnext = self._nnext
            new = self._insert(rem, self._off[node] + size)
            after = nnext[node]
            if after >= 0:
                self._nprev[after] = new
            self._nprev[new] = node
            nnext[new] = after
            nnext[node] = new
        return node

    def _alloc_near_fit(self, size: int) -> int:
        """First fit in the one bin that may hold regions in [size, bin_size(round_up))."""
        b = bin_round_down(size)
        sizes = self._size
        bnext = self._bnext
        node = self._heads[b]
        while node >= 0:
            if sizes[node] >= size:
                self._unlink(node, b)
                return self._take(node, size)
            node = bnext[node]
        return NO_SPACE

    def _insert(self, size: int, offset: int) -> int:
        """File a new free node of `size` at `offset`; neighbour links are the caller's."""
        if size < 8:
            b = size
        else:
            shift = size.bit_length() - 4
            b = (shift << 3) + (size >> shift)
        heads = self._heads
        head = heads[b]
        if head < 0:
            top = b >> 3
            self._used_bins[top] |= 1 << (b & 7)
            self._used_top |= 1 << top
        stack = self._stack
        node = stack.pop() if stack else self._pop_node()
        self._off[node] = offset
        self._size[node] = size
        self._bprev[node] = _NONE
        self._bnext[node] = head
        if head >= 0:
            self._bprev[head] = node
        heads[b] = node
        self._free_storage += size
        return node

    def _remove(self, node: int) -> None:
        """Take free `node` off its bin list and return it to the node stack."""
        size = self._size[node]
        self._unlink(node, bin_round_down(size))
        self._stack.append(node)
        self._free_storage -= size

    def _unlink(self, node: int, b: int) -> None:
        """Take free `node` off bin `b`'s list, clearing bitmap bits if the bin empties."""
        prev = self._bprev[node]
        nxt = self._bnext[node]
        if nxt >= 0:
            self._bprev[nxt] = prev
        if prev >= 0:
            self._bnext[prev] = nxt
            return
        self._heads[b] = nxt
        if nxt < 0:
            top = b >> 3
            m = self._used_bins[top] & ~(1 << (b & 7))
            self._used_bins[top] = m
            if not m:
                self._used_top &= ~(1 << top)

    def _pop_node(self) -> int:
        """An unused node index, doubling the node table when none is left."""
        stack = self._stack
        if not stack:
            n = len(self._off)
            grow = max(n, _INITIAL_NODES)
            for lst in (self._off, self._size, self._bprev, self._bnext, self._nprev, self._nnext):
                lst.extend([_NONE] * grow)
            self._used.extend([False] * grow)
            stack.extend(range(n + grow - 1, n - 1, -1))
        return stack.pop()
