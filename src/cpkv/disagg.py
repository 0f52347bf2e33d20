"""Prefill/decode disaggregation (W7) in one place: the transfer plan and data
moves (:mod:`cpkv.consumers.disagg`) and the two-group driver
(:mod:`cpkv.engine.disagg`). [[RFC-0001:C-DISAGG]]"""

from .consumers.disagg import (TransferPlan, message_nbytes, pack_message, payload_nbytes, plan_transfer,
                               receive_transfer, send_transfer, slot_pairs, unpack_message)
from .engine.disagg import (DisaggConfig, DisaggControl, DisaggFailure, TransferAborted, disagg_rank, format_disagg,
                            parse_disagg, run_disagg, run_disagg_sweep, run_disagg_threads)

__all__ = ["DisaggConfig", "DisaggControl", "DisaggFailure", "TransferAborted", "TransferPlan", "disagg_rank",
           "format_disagg", "message_nbytes", "pack_message", "parse_disagg", "payload_nbytes", "plan_transfer", "receive_transfer",
           "run_disagg", "run_disagg_sweep", "run_disagg_threads", "send_transfer", "slot_pairs", "unpack_message"]
