"""docs/sglang.md: its code block runs (without SGLang installed), and every adapter call its tables name exists."""

import re
from pathlib import Path

from cpkv.consumers.sglang_cache import SGLangPrefixCache
from cpkv.contract.sglang import SGLangAllocator, SGLangKVShardAllocator

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def test_code_block_runs():
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        exec(compile(block, str(DOC), "exec"), {})


#: Calls a table row says cpkv does not provide, and SGLang's own functions a row names.
NOT_PROVIDED = ("resize", "debug_check_classes", "_release_page_ids")
SGLANG_FUNCTIONS = ("page_interleave_shard_size",)


def test_every_call_in_the_tables_exists():
    text = DOC.read_text()
    alloc, rest = text.split("## The kv-shard allocator")
    shard, cache = rest.split("## The prefix cache")
    a = SGLangAllocator(64, 4)
    for part, obj in ((alloc, a), (shard, SGLangKVShardAllocator(16, 4, 2)),
                      (cache, SGLangPrefixCache(req_to_token_pool=None, token_to_kv_pool_allocator=a))):
        for row in part.splitlines():
            if not row.startswith("| `"):
                continue
            names = re.findall(r"`([a-z_]+)[(`]", row.split("|")[1])
            for name in names:
                if name in NOT_PROVIDED or name in SGLANG_FUNCTIONS:
                    continue
                assert name == "__init__" or hasattr(obj, name), (type(obj).__name__, name)
    for name in NOT_PROVIDED:
        assert not hasattr(SGLangKVShardAllocator, name), name
