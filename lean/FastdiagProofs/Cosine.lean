import FastdiagProofs.Basic

/-!
# Cosine similarity of attention patterns

For vectors `u v : ι → ℝ` (for `fastdiag`, `ι = Fin n`, or rows × keys for a whole batch):

* `dot u v = ∑ i, u i * v i`, `norm2 u = √(∑ i, u i ^ 2)`,
* `cosine u v = dot u v / (norm2 u * norm2 v)` (Lean's `x / 0 = 0` makes it `0` for a zero vector).

Main results:

* `cosine_nonneg`: non-negative vectors have cosine `≥ 0`.
* `cosine_le_one`: every cosine is `≤ 1` (Cauchy–Schwarz, `Finset.sum_mul_sq_le_sq_mul_sq`).
* `cosine_eq_one_iff`: for non-zero vectors, cosine `= 1` iff `v = c • u` with `c > 0`.
* `cosine_eq_one_iff_eq`: for probability vectors, cosine `= 1` iff the vectors are equal.
-/

noncomputable section

namespace FastdiagProofs

variable {ι : Type*} [Fintype ι]

/-- Dot product `∑ i, u i * v i`. -/
def dot (u v : ι → ℝ) : ℝ := ∑ i, u i * v i

/-- Euclidean norm `√(∑ i, u i ^ 2)`. -/
def norm2 (u : ι → ℝ) : ℝ := Real.sqrt (∑ i, u i ^ 2)

/-- Cosine similarity `⟨u, v⟩ / (‖u‖ ‖v‖)`. -/
def cosine (u v : ι → ℝ) : ℝ := dot u v / (norm2 u * norm2 v)

theorem sum_sq_nonneg (u : ι → ℝ) : 0 ≤ ∑ i, u i ^ 2 :=
  Finset.sum_nonneg fun i _ => sq_nonneg (u i)

theorem norm2_nonneg (u : ι → ℝ) : 0 ≤ norm2 u :=
  Real.sqrt_nonneg _

theorem norm2_sq (u : ι → ℝ) : norm2 u ^ 2 = ∑ i, u i ^ 2 :=
  Real.sq_sqrt (sum_sq_nonneg u)

/-- A vector with a non-zero entry has positive norm. -/
theorem norm2_pos {u : ι → ℝ} (hu : ∃ i, u i ≠ 0) : 0 < norm2 u := by
  obtain ⟨i, hi⟩ := hu
  have hi2 : 0 < u i ^ 2 := lt_of_le_of_ne (sq_nonneg (u i)) (Ne.symm (pow_ne_zero 2 hi))
  have hle : u i ^ 2 ≤ ∑ j, u j ^ 2 :=
    Finset.single_le_sum (fun j _ => sq_nonneg (u j)) (Finset.mem_univ i)
  unfold norm2
  exact Real.sqrt_pos.mpr (lt_of_lt_of_le hi2 hle)

/-- **Cauchy–Schwarz**: `⟨u, v⟩ ≤ ‖u‖ ‖v‖`. -/
theorem dot_le_norm2_mul_norm2 (u v : ι → ℝ) : dot u v ≤ norm2 u * norm2 v := by
  have hcs : (∑ i, u i * v i) ^ 2 ≤ (∑ i, u i ^ 2) * ∑ i, v i ^ 2 :=
    Finset.sum_mul_sq_le_sq_mul_sq (s := Finset.univ) (f := u) (g := v)
  have h : |∑ i, u i * v i| ≤ Real.sqrt ((∑ i, u i ^ 2) * ∑ i, v i ^ 2) :=
    Real.abs_le_sqrt hcs
  rw [Real.sqrt_mul (sum_sq_nonneg u)] at h
  unfold dot norm2
  exact (le_abs_self _).trans h

/-- The sum-of-squares identity behind the equality case of Cauchy–Schwarz:
`∑ i, (‖v‖ u i - ‖u‖ v i)² = 2 ‖u‖ ‖v‖ (‖u‖ ‖v‖ - ⟨u, v⟩)`. -/
theorem sum_sq_sub_eq (u v : ι → ℝ) :
    ∑ i, (norm2 v * u i - norm2 u * v i) ^ 2
      = 2 * (norm2 u * norm2 v) * (norm2 u * norm2 v - dot u v) := by
  have hpt : ∀ i, (norm2 v * u i - norm2 u * v i) ^ 2
      = norm2 v ^ 2 * u i ^ 2 - 2 * (norm2 u * norm2 v) * (u i * v i)
        + norm2 u ^ 2 * v i ^ 2 := fun i => by ring
  simp only [hpt]
  rw [Finset.sum_add_distrib, Finset.sum_sub_distrib, ← Finset.mul_sum, ← Finset.mul_sum,
    ← Finset.mul_sum, ← norm2_sq u, ← norm2_sq v, dot]
  ring

/-- Cosine is symmetric, so the mean over ordered pairs `a ≠ b` equals the mean over `a < b`. -/
theorem cosine_comm (u v : ι → ℝ) : cosine u v = cosine v u := by
  have h : dot u v = dot v u := by
    unfold dot
    exact Finset.sum_congr rfl fun i _ => mul_comm (u i) (v i)
  unfold cosine
  rw [h, mul_comm (norm2 u) (norm2 v)]

/-- Cosine of two non-negative vectors is non-negative. -/
theorem cosine_nonneg {u v : ι → ℝ} (hu : ∀ i, 0 ≤ u i) (hv : ∀ i, 0 ≤ v i) :
    0 ≤ cosine u v := by
  unfold cosine dot
  exact div_nonneg (Finset.sum_nonneg fun i _ => mul_nonneg (hu i) (hv i))
    (mul_nonneg (norm2_nonneg u) (norm2_nonneg v))

/-- Cosine is at most `1` (for all vectors; zero vectors give cosine `0`). -/
theorem cosine_le_one (u v : ι → ℝ) : cosine u v ≤ 1 := by
  unfold cosine
  rcases (mul_nonneg (norm2_nonneg u) (norm2_nonneg v)).eq_or_lt with h | h
  · rw [← h, div_zero]
    exact zero_le_one
  · rw [div_le_one h]
    exact dot_le_norm2_mul_norm2 u v

/-- Cosine of two non-negative vectors lies in `[0, 1]`. -/
theorem cosine_mem_Icc {u v : ι → ℝ} (hu : ∀ i, 0 ≤ u i) (hv : ∀ i, 0 ≤ v i) :
    cosine u v ∈ Set.Icc (0 : ℝ) 1 :=
  ⟨cosine_nonneg hu hv, cosine_le_one u v⟩

/-- For non-zero vectors, cosine is `1` iff they are positively proportional. -/
theorem cosine_eq_one_iff {u v : ι → ℝ} (hu : ∃ i, u i ≠ 0) (hv : ∃ i, v i ≠ 0) :
    cosine u v = 1 ↔ ∃ c : ℝ, 0 < c ∧ ∀ i, v i = c * u i := by
  have ha : 0 < norm2 u := norm2_pos hu
  have hb : 0 < norm2 v := norm2_pos hv
  have hab : 0 < norm2 u * norm2 v := mul_pos ha hb
  constructor
  · intro h
    unfold cosine at h
    have hD : dot u v = norm2 u * norm2 v := (div_eq_one_iff_eq hab.ne').mp h
    have hzero : ∑ i, (norm2 v * u i - norm2 u * v i) ^ 2 = 0 := by
      rw [sum_sq_sub_eq, hD, sub_self, mul_zero]
    have hterm := (Finset.sum_eq_zero_iff_of_nonneg
      (fun i _ => sq_nonneg (norm2 v * u i - norm2 u * v i))).mp hzero
    refine ⟨norm2 v / norm2 u, div_pos hb ha, fun i => ?_⟩
    have hi : norm2 v * u i - norm2 u * v i = 0 :=
      (pow_eq_zero_iff (n := 2) (by norm_num)).mp (hterm i (Finset.mem_univ i))
    rw [div_mul_eq_mul_div, eq_div_iff ha.ne']
    linear_combination (-1 : ℝ) * hi
  · rintro ⟨c, hc, hcv⟩
    have hnv : norm2 v = c * norm2 u := by
      have hsum : ∑ i, v i ^ 2 = c ^ 2 * ∑ i, u i ^ 2 := by
        rw [Finset.mul_sum]
        exact Finset.sum_congr rfl fun i _ => by rw [hcv i]; ring
      unfold norm2
      rw [hsum, Real.sqrt_mul (sq_nonneg c), Real.sqrt_sq hc.le]
    have hdot : dot u v = c * norm2 u ^ 2 := by
      unfold dot
      rw [norm2_sq, Finset.mul_sum]
      exact Finset.sum_congr rfl fun i _ => by rw [hcv i]; ring
    unfold cosine
    rw [hdot, hnv, div_eq_one_iff_eq (mul_pos ha (mul_pos hc ha)).ne']
    ring

/-- A non-zero vector has cosine `1` with itself. -/
theorem cosine_self {u : ι → ℝ} (hu : ∃ i, u i ≠ 0) : cosine u u = 1 :=
  (cosine_eq_one_iff hu hu).mpr ⟨1, one_pos, fun i => (one_mul (u i)).symm⟩

/-- For probability vectors, cosine is `1` iff the vectors are equal. -/
theorem cosine_eq_one_iff_eq {u v : ι → ℝ} (hu : IsProbVec u) (hv : IsProbVec v) :
    cosine u v = 1 ↔ u = v := by
  constructor
  · intro h
    obtain ⟨c, _, hcv⟩ := (cosine_eq_one_iff hu.exists_ne_zero hv.exists_ne_zero).mp h
    have hsum : ∑ i, v i = c * ∑ i, u i := by
      rw [Finset.mul_sum]
      exact Finset.sum_congr rfl fun i _ => hcv i
    rw [hu.sum_eq_one, hv.sum_eq_one, mul_one] at hsum
    funext i
    rw [hcv i, ← hsum, one_mul]
  · rintro rfl
    exact cosine_self hu.exists_ne_zero

end FastdiagProofs

end
