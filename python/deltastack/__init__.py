"""deltastack's Python side: ``deltastack.torch`` holds the torch custom ops and the transformers patcher
(docs/torch.md)."""

__version__ = "0.1.0"
