"""Where endpoints and their ready replicas come from: a static file (static.py) or the
Kubernetes API (kube.py). Both only write into the Registry."""
