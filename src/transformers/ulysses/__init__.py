"""DeepSpeed-Ulysses sequence parallelism with exact attention masks (`masks.py`).

Patch `0006-ulysses-exact-masks` hands the attention wrapper DeepSpeed registers with transformers to
`masks.wrap_registered_attention`; nothing here is imported or registered otherwise.
"""
