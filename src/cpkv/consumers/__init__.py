"""Consumers of the allocation contract: the shared KV pool (W3, W4), the prefix
cache (W5) and the prefill -> decode transfer (W7). They take the allocation
result as given and never re-derive owners ([[RFC-0001:C-DOWNSTREAM-CONTRACT]])."""
