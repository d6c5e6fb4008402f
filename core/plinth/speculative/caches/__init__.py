"""n-gram caches shipped for known models (``--spec ngram-cache``): each ``<name>.npz`` was made by
``python -m plinth.speculative.ngram_cache`` from that model's self-distilled answers, and its model card
``<name>.md`` says how (:mod:`plinth.speculative.ngram_cache`)."""
