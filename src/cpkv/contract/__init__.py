"""The contract every consumer relies on: layout arithmetic, owner plans,
owner-lane allocation and the errors that refuse a plan."""
