"""The recall path: rank a query over the vector and keyword indexes (`fusion`), confirm visibility,
open the texts, and cache the ranking in the recall cache store (`recall`)."""
