"""Ingest: step records into the database (ingestor: the HTTP and in-process path; columns: the
column batch checks; quota: new runs per token per hour). May import: store and the root modules."""
