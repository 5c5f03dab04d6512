"""Workers for models that score rather than generate: embeddings and rerank.

An embedding or reranker model gets the same kind of worker process as a text model (one
per loaded model, killed safely, driven by the same protocol), with its own engine and a
simpler scheduler: a request is a list of inputs, run through the model in padded
batches, one batch per step, so a Cancel or a new request is seen between any two.
"""
