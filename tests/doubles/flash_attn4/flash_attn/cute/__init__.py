"""The layout flash-attn 4 installs (pip package flash-attn-4: `packages = ["flash_attn.cute"]`): a namespace
package `flash_attn` holding only `flash_attn.cute`, whose varlen function has another signature
(q, k, v, qv=None, cu_seqlens_q=None, ...). `import flash_attn` succeeds; `from flash_attn import
flash_attn_varlen_func` fails."""


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, **kwargs):
    raise AssertionError("flash-attn 4's interface must not be called through the flash-attn 2 adapter")
