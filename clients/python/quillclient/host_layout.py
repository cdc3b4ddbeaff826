"""What QuillHiCacheStorage needs of an SGLang host pool, checked when the pool is registered.

SGLang reads and writes pages two ways (SGLang 0.5.23, `sglang/srt/mem_cache/pool_host/`):

- as a flat data page (`get_data_page(index)`, `get_dummy_flat_data_page()`,
  `set_from_flat_data_page(index, page)`): the generic path and the v2 calls. A layout that
  cannot give one (MHA `page_unified`; MLA `page_first_kv_split`) fails there, and so must
  the attach;
- as buffers in the pool itself (`get_page_buffer_meta(host_indices)` -> addresses and
  sizes): the v1 path. A page is one buffer (MLA `page_first`), two (MHA `page_first`: K, V),
  2 x layers (MHA `layer_first`: K and V of each layer in turn), layers (MLA `layer_first`),
  or up to four (MLA `page_first_kv_split`: K, V, indexer K, its scales).

On the v1 path a page is gathered from its buffers into one object and scattered back into
them, in the order of the generic path's flat page where there is one: K of every layer,
then V of every layer (`[:, :, index:index + page_size]` of a `layer_first` MHA pool, the K
half then the V half of a `page_first` one), so the one object under one key is the same
bytes whichever path wrote it. (So a v1 page and a generic page never differ, `exists` and
`get` look at the same object, and a page is stored whole or not at all.)
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any


def byte_view(target: Any, nbytes: int | None = None) -> memoryview:
    """A flat byte view of a page: a buffer, a CPU torch tensor, or an address with a size in bytes."""
    if isinstance(target, int) and not isinstance(target, bool):
        if nbytes is None or nbytes < 0:
            raise ValueError("an address target needs its size in bytes")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(target)).cast("B")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        if target.device.type != "cpu":
            raise ValueError(f"HiCache storage reads host tensors, got one on {target.device}")
        if not target.is_contiguous():
            raise ValueError("HiCache storage needs contiguous tensors")
        target = target.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(target)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view if nbytes is None else view[:nbytes]


class _Indices(list):
    """Host indices where neither torch nor numpy is loaded: the pools call `.tolist()`."""

    def tolist(self) -> list:
        return list(self)


def one_page_indices(pool: Any) -> Any:
    """The host indices of the pool's first page, in the type SGLang passes (a torch tensor)."""
    n = int(getattr(pool, "logical_page_size", None) or getattr(pool, "page_size", 1) or 1)
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.arange(n, dtype=torch.int64)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        return numpy.arange(n, dtype=numpy.int64)
    return _Indices(range(n))


def _describe(pool: Any) -> str:
    return f"{type(pool).__name__} (layout {getattr(pool, 'layout', '?')!r})"


def _nbytes(page: Any) -> int:
    return byte_view(page).nbytes


def check_flat_pages(pool: Any, name: str) -> int:
    """The size of the pool's flat data page; ValueError if the pool gives none, or one of
    another size than its dummy page (what a read lands in)."""
    try:
        page = _nbytes(pool.get_data_page(0, flat=True))
        dummy = _nbytes(pool.get_dummy_flat_data_page())
    except Exception as e:  # noqa: BLE001 - any refusal of the pool's own calls is the answer
        raise ValueError(f"QuillHiCacheStorage cannot store pool {name!r}: {_describe(pool)} gives no flat "
                         f"data page ({type(e).__name__}: {e})") from e
    if page != dummy:
        raise ValueError(f"QuillHiCacheStorage cannot store pool {name!r}: {_describe(pool)} gives flat pages "
                         f"of {page} bytes but reads into dummy pages of {dummy}")
    return page


class V1PageLayout:
    """How one page's buffers (from get_page_buffer_meta) make one object."""

    __slots__ = ("per_page", "order", "nbytes", "generic_size")

    def __init__(self, per_page: int, order: list[int], nbytes: int, generic_size: bool) -> None:
        self.per_page = per_page  # buffers per page
        self.order = order  # their order in the object
        self.nbytes = nbytes  # the object's size
        self.generic_size = generic_size  # the same size as the pool's flat data page

    def pages(self, ptrs: Sequence[int], sizes: Sequence[int], n_pages: int) -> list[Any]:
        """Per page a writable view, or the list of views to gather from / scatter into."""
        per = self.per_page
        if len(ptrs) != per * n_pages or len(sizes) != len(ptrs):
            raise ValueError(f"{len(ptrs)} host buffers for {n_pages} pages, expected {per} a page")
        out: list[Any] = []
        for p in range(n_pages):
            views = [_address_view(ptrs[p * per + j], sizes[p * per + j]) for j in self.order]
            out.append(views[0] if per == 1 else views)
        return out


def _address_view(ptr: int, size: int) -> memoryview:
    return byte_view(int(ptr), int(size))


def v1_page_layout(pool: Any, is_mla: bool) -> V1PageLayout:
    """The pool's v1 page layout; ValueError if its get_page_buffer_meta refuses the pool."""
    try:
        ptrs, sizes = pool.get_page_buffer_meta(one_page_indices(pool))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"QuillHiCacheStorage with interface_v1 cannot use {_describe(pool)}: its "
                         f"get_page_buffer_meta refuses it ({type(e).__name__}: {e}); leave interface_v1 "
                         "out to use the generic path") from e
    per = len(ptrs)
    if per == 0 or len(sizes) != per or any(int(s) <= 0 for s in sizes):
        raise ValueError(f"QuillHiCacheStorage with interface_v1 cannot use {_describe(pool)}: "
                         f"get_page_buffer_meta gives {per} buffers of sizes {list(sizes)[:8]} for one page")
    layers = int(getattr(pool, "layer_num", 0) or 0)
    if getattr(pool, "layout", None) == "layer_first" and not is_mla and per == 2 * layers:
        order = list(range(0, per, 2)) + list(range(1, per, 2))  # (layer, K/V) -> K of all layers, then V
    else:
        order = list(range(per))
    nbytes = sum(int(s) for s in sizes)
    try:
        generic = _nbytes(pool.get_dummy_flat_data_page()) == nbytes
    except Exception:  # noqa: BLE001 - a pool with no flat pages (MLA page_first_kv_split)
        generic = False
    return V1PageLayout(per, order, nbytes, generic)
