"""The dispatcher: worker registry, jobs, plans and split assignment."""
