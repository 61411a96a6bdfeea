"""dart_train: train DART heads for any Hugging Face causal LM (data, loss, training loop)."""
