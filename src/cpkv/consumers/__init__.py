"""Consumers of the allocation contract: the shared KV pool (direct write, fence,
read), the prefix cache, the host tier and the prefill -> decode transfer
(:mod:`~cpkv.consumers.transfer`). They take the allocation result as given and
never re-derive owners ([[RFC-0001:C-DOWNSTREAM-CONTRACT]])."""
