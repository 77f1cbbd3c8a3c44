"""Jobs as every component sees them: the request and record models, the pure rules of a
record's state, the verbs of the job API, admissions. No I/O; the queue (``queue/``) and the
batch engine (``batch/``) build on it, never the other way round."""
