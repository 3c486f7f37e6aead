"""Which layers share a block table: the KV cache groups.

Mirrors the grouping half of vllm/v1/core/kv_cache_utils.py
(``get_kv_cache_groups``, ``is_kv_cache_spec_uniform``,
``create_kv_cache_group_specs``, ``get_uniform_page_size``,
``is_kv_cache_page_size_uniform``, ``unify_kv_cache_spec_page_size``,
``_get_kv_cache_groups_uniform_spec``, ``_get_kv_cache_groups_uniform_type``,
``_get_kv_cache_groups_uniform_page_size``); kv_cache_utils re-exports the
public names. A group is a set of layers with one ``KVCacheSpec`` that the KV
manager treats as one layer: one block table, one kind of attention.

Alike layers make one group (a Llama), and so do full-attention layers of
different sizes (a draft model beside its target). Layers of different kinds
(Gemma-2: sliding window on even layers, full attention on odd ones) make a
group per kind, cut to equal sizes: every group has the same number of
layers, so a block id is a page of the same size in each (see
``_get_kv_cache_groups_uniform_page_size``). Left out: DeepSeek-V4's grouped
uniform-type specs, hidden-state caches, ``--disable-hybrid-kv-cache-manager``
(``unify_hybrid_kv_cache_specs``) and attention-free models beyond the empty
case.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from tracevllm.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from tracevllm.logger import init_logger
from tracevllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

logger = init_logger(__name__)


def create_kv_cache_group_specs(
    kv_cache_spec: dict[str, KVCacheSpec], grouped_layer_names: list[list[str]]
) -> list[KVCacheGroupSpec]:
    """A group per list of layer names, its spec the merge of theirs."""
    groups = []
    for layer_names in grouped_layer_names:
        specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, specs[0].merge(specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether every layer has the same spec (one merged spec can stand for all)."""
    specs = list(kv_cache_spec.values())
    if not specs:
        return True
    try:
        specs[0].merge(specs)
    except AssertionError:
        return False
    return True


def get_uniform_page_size(kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    assert len(page_sizes) == 1, f"KV cache groups with different page sizes: {page_sizes}"
    return page_sizes.pop()


def is_kv_cache_page_size_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def unify_kv_cache_spec_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Equal pages for every layer: a layer with smaller pages gets bigger blocks.

    The pool hands out one size of block; a layer whose page is half the
    largest holds twice the tokens per block. Raises NotImplementedError if a
    page size does not divide the largest.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec
    max_page_size = max(page_sizes)
    new_kv_cache_spec: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_spec.items():
        if spec.page_size_bytes == max_page_size:
            new_kv_cache_spec[name] = spec
            continue
        if max_page_size % spec.page_size_bytes != 0:
            raise NotImplementedError(
                "The page size of the layer is not divisible by the maximum page size. "
                "Cannot unify by adjusting block_size."
            )
        ratio = max_page_size // spec.page_size_bytes
        new_spec = replace(spec, block_size=spec.block_size * ratio)
        assert new_spec.page_size_bytes == max_page_size
        new_kv_cache_spec[name] = new_spec
    return new_kv_cache_spec


def _get_kv_cache_groups_uniform_spec(
    kv_cache_specs: dict[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    """Every layer alike: one group."""
    return create_kv_cache_group_specs(kv_cache_specs, [list(kv_cache_specs)])


def _get_kv_cache_groups_uniform_type(spec: UniformTypeKVCacheSpecs) -> list[KVCacheGroupSpec]:
    """One kind of attention, layers of different sizes: one group, one page of each."""
    return [KVCacheGroupSpec(list(spec.kv_cache_specs), spec)]


# --8<-- [start:get_kv_cache_groups_uniform_page_size]
def _get_kv_cache_groups_uniform_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    """Groups of equal size, each of one kind of attention, for a hybrid model.

    A hybrid model repeats a pattern, e.g. (1 full, 2 sliding) x 10 layers.
    The KV manager gives each layer of the pattern its own block table and
    each table serves the pattern's 10 repeats: 3 groups of 10 layers. The
    model runner then lays the cache out as 10 tensors, each shared by one
    layer of every group: a block id names the same page in each, and since
    the pool hands any id to one group at a time, the groups never collide.

    Layers are sorted by spec; each kind is cut into groups of
    ``group_size`` layers, the fewest layers of any kind (or the most, when
    the counts are within 1.5x: 12 sliding + 13 full makes 2 groups of 13,
    one padded, not 1 + 2). Layer i of a kind goes to group ``i % num_groups``
    (``layers[i::num_groups]``), so that with pipeline parallelism each stage
    keeps its share of every group. Assumes one page size (see
    ``unify_kv_cache_spec_page_size``) and one block size per group.

    E.g. Gemma-2 with 4 layers, sliding on 0 and 2: (layers 0, 2: sliding),
    (layers 1, 3: full).
    """
    same_type_layers: dict[KVCacheSpec, list[str]] = defaultdict(list)
    for layer_name, layer_spec in kv_cache_spec.items():
        same_type_layers[layer_spec].append(layer_name)

    min_num_layers = min(len(layers) for layers in same_type_layers.values())
    max_num_layers = max(len(layers) for layers in same_type_layers.values())
    group_size = min_num_layers
    if max_num_layers < min_num_layers * 1.5:
        group_size = max_num_layers
    grouped_layers = []
    for layers in same_type_layers.values():
        num_padding_layers = group_size - len(layers) % group_size
        if num_padding_layers != group_size:
            logger.warning(
                "Add %d padding layers, may waste at most %.2f%% KV cache memory",
                num_padding_layers,
                num_padding_layers / len(layers) * 100,
            )
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            grouped_layers.append(layers[i::num_groups])
    return create_kv_cache_group_specs(kv_cache_spec, grouped_layers)


# --8<-- [end:get_kv_cache_groups_uniform_page_size]


def get_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Split the model's layers into KV cache groups (vLLM's order of cases)."""
    if not kv_cache_spec:
        return []  # an attention-free model
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return _get_kv_cache_groups_uniform_spec(kv_cache_spec)
    if uniform_spec := UniformTypeKVCacheSpecs.from_specs(kv_cache_spec):
        return _get_kv_cache_groups_uniform_type(uniform_spec)
    # The pool allocates one page size: make them equal, then group by kind.
    kv_cache_spec = unify_kv_cache_spec_page_size(kv_cache_spec)
    return _get_kv_cache_groups_uniform_page_size(kv_cache_spec)
