"""The I/W split of the backward (placeholder until it lands)."""


class WeightGradSplit:
    def __init__(self, model_chunks):
        raise ValueError(
            "this schedule splits the backward into I (input gradient) and W (weight gradient), "
            "which needs the I/W split; it is not available yet: use gpipe, 1f1b or interleaved")
