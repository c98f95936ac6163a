"""Block-by-block execution of a decoder below calibration, sensitivity and the streamed
evaluation: one block's weights at a time (``stream``), the embeddings then each block over a
set of inputs (``execute``), those inputs in RAM or spilled to files (``activations``), and the
device a block's work runs on (``device``)."""
