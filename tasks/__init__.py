"""The reference deployment's business jobs and views, written against taskplatform's public API."""
