import FastdiagProofs.Cosine
import FastdiagProofs.Entropy

/-!
# Additivity of the accumulated head statistics

`fastdiag` accumulates, per layer, a Gram matrix `G[h, h'] = ∑_rows ⟨v_h, v_h'⟩`, the per-head
sum of row entropies and the row count.  All three are sums over rows, so the statistics of a
concatenation of two batches are the sums of the two batches' statistics.

Main results:

* `sum_fin_append`: a sum over the rows of `Fin.append A B` splits into the two parts
  (`Fin.sum_univ_add`).
* `gram_ofRows_append`, `entropySum_ofRows_append`, `ofRows_append`: the statistics of a
  concatenated batch are the sums of the parts' statistics.
* `gramOn_union`, `entropySumOn_union`: the same for disjoint sets of row indices
  (`Finset.sum_union`).
* `gram_ofRows_eq_dot_flatten`, `cosine_flatten_eq_gram`: the cosine computed from the Gram
  matrix, `G[h, h'] / (√G[h, h] √G[h', h'])`, is `cosine` of the flattened (rows × keys)
  patterns, so the `Cosine` and `Sync` results apply to it.
-/

noncomputable section

namespace FastdiagProofs

/-- Accumulated statistics of a batch of rows for the heads `η` of one layer. -/
@[ext]
structure HeadStats (η : Type*) where
  /-- `gram h h' = ∑ over rows of ⟨v_h, v_h'⟩`. -/
  gram : η → η → ℝ
  /-- `entropySum h = ∑ over rows of the row entropy of head h`. -/
  entropySum : η → ℝ
  /-- Number of rows accumulated. -/
  rows : ℕ

namespace HeadStats

variable {η : Type*}

/-- Merging two accumulators adds every field (the `+` of `fastdiag.HeadStats`). -/
instance : Add (HeadStats η) :=
  ⟨fun a b => ⟨a.gram + b.gram, a.entropySum + b.entropySum, a.rows + b.rows⟩⟩

theorem add_gram (a b : HeadStats η) : (a + b).gram = a.gram + b.gram := rfl

theorem add_entropySum (a b : HeadStats η) :
    (a + b).entropySum = a.entropySum + b.entropySum := rfl

theorem add_rows (a b : HeadStats η) : (a + b).rows = a.rows + b.rows := rfl

end HeadStats

/-- A sum over the rows of a concatenation is the sum of the sums over the parts. -/
theorem sum_fin_append {α M : Type*} [AddCommMonoid M] {R₁ R₂ : ℕ}
    (A : Fin R₁ → α) (B : Fin R₂ → α) (f : α → M) :
    ∑ r, f (Fin.append A B r) = ∑ r, f (A r) + ∑ r, f (B r) := by
  rw [Fin.sum_univ_add]
  simp only [Fin.append_left, Fin.append_right]

section Rows

variable {η κ : Type*} [Fintype κ]

/-- Statistics of a batch of `R` rows; `X r h : κ → ℝ` is row `r` of head `h`'s pattern. -/
def ofRows {R : ℕ} (X : Fin R → η → κ → ℝ) : HeadStats η where
  gram h h' := ∑ r, dot (X r h) (X r h')
  entropySum h := ∑ r, entropy (X r h)
  rows := R

theorem gram_ofRows_append {R₁ R₂ : ℕ} (A : Fin R₁ → η → κ → ℝ) (B : Fin R₂ → η → κ → ℝ)
    (h h' : η) :
    (ofRows (Fin.append A B)).gram h h' = (ofRows A).gram h h' + (ofRows B).gram h h' :=
  sum_fin_append A B fun x => dot (x h) (x h')

theorem entropySum_ofRows_append {R₁ R₂ : ℕ} (A : Fin R₁ → η → κ → ℝ)
    (B : Fin R₂ → η → κ → ℝ) (h : η) :
    (ofRows (Fin.append A B)).entropySum h
      = (ofRows A).entropySum h + (ofRows B).entropySum h :=
  sum_fin_append A B fun x => entropy (x h)

/-- The statistics of a concatenation of two batches are the sum of their statistics. -/
theorem ofRows_append {R₁ R₂ : ℕ} (A : Fin R₁ → η → κ → ℝ) (B : Fin R₂ → η → κ → ℝ) :
    ofRows (Fin.append A B) = ofRows A + ofRows B := by
  apply HeadStats.ext
  · funext h h'
    exact gram_ofRows_append A B h h'
  · funext h
    exact entropySum_ofRows_append A B h
  · rfl

/-- Row-major flattening of head `h` over a batch, indexed by `(row, key)`. -/
def flatten {R : ℕ} (X : Fin R → η → κ → ℝ) (h : η) : Fin R × κ → ℝ :=
  fun rk => X rk.1 h rk.2

/-- A Gram entry is the dot product of the flattened patterns. -/
theorem gram_ofRows_eq_dot_flatten {R : ℕ} (X : Fin R → η → κ → ℝ) (h h' : η) :
    (ofRows X).gram h h' = dot (flatten X h) (flatten X h') := by
  show ∑ r, ∑ k, X r h k * X r h' k = ∑ rk : Fin R × κ, X rk.1 h rk.2 * X rk.1 h' rk.2
  exact (Fintype.sum_prod_type
    (f := fun rk : Fin R × κ => X rk.1 h rk.2 * X rk.1 h' rk.2)).symm

theorem norm2_eq_sqrt_dot {ι : Type*} [Fintype ι] (u : ι → ℝ) :
    norm2 u = Real.sqrt (dot u u) := by
  unfold norm2 dot
  simp only [sq]

/-- The cosine computed from the accumulated Gram matrix is the cosine of the flattened
patterns. -/
theorem cosine_flatten_eq_gram {R : ℕ} (X : Fin R → η → κ → ℝ) (h h' : η) :
    cosine (flatten X h) (flatten X h')
      = (ofRows X).gram h h'
        / (Real.sqrt ((ofRows X).gram h h) * Real.sqrt ((ofRows X).gram h' h')) := by
  unfold cosine
  rw [gram_ofRows_eq_dot_flatten, gram_ofRows_eq_dot_flatten, gram_ofRows_eq_dot_flatten,
    ← norm2_eq_sqrt_dot, ← norm2_eq_sqrt_dot]

end Rows

section Finsets

variable {η κ ρ : Type*} [Fintype κ] [DecidableEq ρ]

/-- Gram entry accumulated over a finite set `s` of row indices. -/
def gramOn (s : Finset ρ) (X : ρ → η → κ → ℝ) (h h' : η) : ℝ :=
  ∑ r ∈ s, dot (X r h) (X r h')

/-- Entropy sum accumulated over a finite set `s` of row indices. -/
def entropySumOn (s : Finset ρ) (X : ρ → η → κ → ℝ) (h : η) : ℝ :=
  ∑ r ∈ s, entropy (X r h)

theorem gramOn_union {s t : Finset ρ} (hst : Disjoint s t) (X : ρ → η → κ → ℝ) (h h' : η) :
    gramOn (s ∪ t) X h h' = gramOn s X h h' + gramOn t X h h' := by
  unfold gramOn
  exact Finset.sum_union hst

theorem entropySumOn_union {s t : Finset ρ} (hst : Disjoint s t) (X : ρ → η → κ → ℝ)
    (h : η) : entropySumOn (s ∪ t) X h = entropySumOn s X h + entropySumOn t X h := by
  unfold entropySumOn
  exact Finset.sum_union hst

end Finsets

end FastdiagProofs

end
