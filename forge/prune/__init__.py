"""Expert pruning: profile routed experts on a text (collect), build ds4-style prune masks (mask), remove
experts from a GGUF (apply). Only ``collect`` needs torch and the runtime."""
