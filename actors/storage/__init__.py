"""Where files live: local folders written durably, storage URIs (s3://...), base model sources and their caches."""
