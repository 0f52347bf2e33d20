"""The contract every consumer relies on: layout arithmetic, owner plans,
owner-lane allocation and the errors that refuse a plan.

Each job is its own module (:mod:`~cpkv.contract.allocator` the core,
:mod:`~cpkv.contract.sglang` SGLang's calls over it, ...); importing this
package imports none of them."""
