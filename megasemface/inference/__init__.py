"""Translation with a trained model: batched greedy and beam search, the Translator."""
