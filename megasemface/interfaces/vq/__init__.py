"""VQ-SemFace's interface: the Gumbel-softmax vector quantiser, its flat codebook split over
model-parallel ranks, its counter-based randomness and its code usage."""
