"""What a drafter carries besides the target: trained heads (heads), SpecEE's exit predictors
(predictors), the datastore of the model's own continuations (datastore) and KNN-SSD's skip sets
and anchors (knn). Each is a folder on disk, written and read through one helper (folder) and,
for the default model, shipped with jspec (shipped); each declares the sharding of its arrays."""
