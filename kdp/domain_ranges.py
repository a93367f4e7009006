"""Declared per-column ranges of scikit-learn's bundled tables: domain bounds,
not statistics of the records.

Each range is a domain a data owner would state for the measurement from what
it is and its unit: the lower end is the quantity's natural limit (0 for a
size, a spread, a ratio or a concentration) or a round floor of the
population (a still wine's 8 % alcohol, a sepal's 3 cm); the upper end is a
round number above any plausible value. They were written with the tables'
documentation at hand, which also lists each column's minimum and maximum, so
every end is a natural zero or a round number beyond those by at least a
tenth of the range, never one of them. Every record lies inside its range,
and no end is a record's value except the natural zero of concavity and
concave points, which the nuclei without a concavity take (the tests check
both). The columns follow the order of ``load_*().data``.

The mapping of a table is then a fixed public function of each row, so it
costs no privacy whatever the records are. The bounds are wider than the
records' spread (they fill about two thirds of a range on average), which
is the price of not reading the data: ranges fitted to the records would
have to be paid for with privacy (e.g. DP quantiles).

This module imports nothing, so that the benchmarks' baseline environments
(which do not install kdp) can read the same constants from its file.
"""

# Wisconsin diagnostic breast cancer (Street, Wolberg and Mangasarian 1993):
# ten measurements of the cell nuclei in an image, each as its mean over the
# nuclei, its standard error, and its "worst" value (mean of the three
# largest). Radius, texture (standard deviation of grey levels), perimeter and
# area are in the image's units; smoothness, compactness, concavity, concave
# points, symmetry and fractal dimension are non-negative shape measures.
_BREAST_CANCER_MEAN = (
    (0.0, 40.0), (0.0, 50.0), (0.0, 250.0), (0.0, 3000.0), (0.0, 0.25),
    (0.0, 0.5), (0.0, 0.5), (0.0, 0.25), (0.0, 0.4), (0.0, 0.15))
_BREAST_CANCER_SE = (
    (0.0, 4.0), (0.0, 6.0), (0.0, 30.0), (0.0, 1000.0), (0.0, 0.05),
    (0.0, 0.2), (0.0, 0.5), (0.0, 0.1), (0.0, 0.1), (0.0, 0.05))
_BREAST_CANCER_WORST = (
    (0.0, 50.0), (0.0, 60.0), (0.0, 300.0), (0.0, 5000.0), (0.0, 0.3),
    (0.0, 1.5), (0.0, 1.5), (0.0, 0.4), (0.0, 0.8), (0.0, 0.25))
BREAST_CANCER = _BREAST_CANCER_MEAN + _BREAST_CANCER_SE + _BREAST_CANCER_WORST

# Wine recognition (Forina et al.; chemical analysis of Italian still wines):
# alcohol (% vol), malic acid, ash, alcalinity of ash, magnesium (mg/l), total
# phenols, flavanoids, nonflavanoid phenols, proanthocyanins, colour intensity,
# hue, OD280/OD315 of diluted wines (ratio of absorbances), proline (mg/l).
WINE = ((8.0, 16.0), (0.0, 8.0), (1.0, 4.0), (5.0, 35.0), (50.0, 200.0),
        (0.0, 5.0), (0.0, 6.0), (0.0, 1.0), (0.0, 4.0), (0.0, 15.0),
        (0.0, 2.0), (0.0, 5.0), (0.0, 2000.0))

# Iris (Fisher 1936): sepal length, sepal width, petal length, petal width of
# an iris flower, in whole centimetres.
IRIS = ((3.0, 9.0), (1.0, 5.0), (0.0, 8.0), (0.0, 3.0))

#: the ranges by scikit-learn dataset name (``sklearn.datasets.load_<name>``)
RANGES = {"breast_cancer": BREAST_CANCER, "wine": WINE, "iris": IRIS}
