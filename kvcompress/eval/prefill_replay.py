"""One full prefill, many compressions: `SharedPrefill` lives in `kvcompress.integration.prefill` (re-exported here)."""

from ..integration.prefill import SharedPrefill, continuation_logits

__all__ = ["SharedPrefill", "continuation_logits"]
